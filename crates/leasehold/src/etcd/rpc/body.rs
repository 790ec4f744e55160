//! Request bodies that say they have ended with their last message.
//!
//! tonic's request body learns that its messages have run out only when it is polled
//! once more, so hyper sends a unary call's message and then, apart, an empty DATA frame
//! that ends the stream. h2 writes a message of 256 bytes or more from its own buffer
//! (not copied), so that frame then costs a write of its own: an extra system call at
//! both ends of every call whose message is that long (an acquire's put, with its holder
//! record, always is). Looking one frame ahead lets hyper end the stream with the
//! message's own frame.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tonic::body::Body;
use tonic::Status;

/// `body`, ending with its last frame.
pub(super) fn looking_ahead(body: Body) -> Body {
    Body::new(LookingAhead {
        inner: body,
        next: None,
        ended: false,
    })
}

/// A body that, having given a data frame, polls for the next at once: if there is none,
/// it has ended, and says so while its last frame is being sent.
struct LookingAhead {
    inner: Body,
    /// The frame (or error) the look ahead found.
    next: Option<Result<http_body::Frame<bytes::Bytes>, Status>>,
    ended: bool,
}

impl http_body::Body for LookingAhead {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        if let Some(next) = this.next.take() {
            return Poll::Ready(Some(next));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            other => {
                this.ended = other.is_none();
                return Poll::Ready(other);
            }
        };
        if frame.is_data() {
            // Pending leaves the inner body's wake-up registered: the caller polls again.
            if let Poll::Ready(next) = Pin::new(&mut this.inner).poll_frame(cx) {
                this.ended = next.is_none();
                this.next = next;
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.next.is_none() && (self.ended || self.inner.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::future::poll_fn;

    use http_body::Body as _;

    use super::*;

    /// Frames given in turn; `None` is a poll that is not ready yet.
    struct Frames(VecDeque<Option<&'static str>>);

    impl http_body::Body for Frames {
        type Data = bytes::Bytes;
        type Error = Status;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            match self.0.pop_front() {
                None => Poll::Ready(None),
                Some(None) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                Some(Some(data)) => Poll::Ready(Some(Ok(http_body::Frame::data(data.into())))),
            }
        }
    }

    fn looking_ahead(frames: impl IntoIterator<Item = Option<&'static str>>) -> LookingAhead {
        LookingAhead {
            inner: Body::new(Frames(frames.into_iter().collect())),
            next: None,
            ended: false,
        }
    }

    async fn next(body: &mut LookingAhead) -> Option<bytes::Bytes> {
        let frame = poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await?;
        Some(frame.unwrap().into_data().unwrap())
    }

    #[tokio::test]
    async fn a_single_message_ends_the_body_with_its_own_frame() {
        let mut body = looking_ahead([Some("message")]);
        assert!(!body.is_end_stream());
        assert_eq!(next(&mut body).await.as_deref(), Some(&b"message"[..]));
        assert!(body.is_end_stream());
        assert_eq!(next(&mut body).await, None);
    }

    #[tokio::test]
    async fn a_stream_gives_every_frame_in_order_and_ends_only_after_the_last() {
        let mut body = looking_ahead([Some("a"), Some("b"), None, Some("c")]);
        assert_eq!(next(&mut body).await.as_deref(), Some(&b"a"[..]));
        assert!(!body.is_end_stream());
        assert_eq!(next(&mut body).await.as_deref(), Some(&b"b"[..]));
        // The look ahead found nothing ready: not ended.
        assert!(!body.is_end_stream());
        assert_eq!(next(&mut body).await.as_deref(), Some(&b"c"[..]));
        assert!(body.is_end_stream());
        assert_eq!(next(&mut body).await, None);
    }
}
