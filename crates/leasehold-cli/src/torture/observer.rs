//! The election's observer (`--primitive election`): the coordinator, which is never
//! paused, follows the leader with `Election::observe` through the same store URL (and
//! link proxies) as the workers, and logs every leader it reports.

use std::sync::Arc;

use leasehold::{Error, Leasehold};
use tokio::task::JoinHandle;
use tokio::time::sleep;

use super::check::Primitive;
use super::history::Event;
use super::Run;

impl Run {
    /// Starts following the election's leader, for an election; abort the task to stop.
    pub(super) fn observe(self: &Arc<Self>) -> Option<JoinHandle<()>> {
        (self.args.primitive == Primitive::Election).then(|| tokio::spawn(self.clone().follow()))
    }

    /// Logs each leader an observer reports; after an error it looks again, and after
    /// one that refused a term gone back it starts a new observer (a new name in the
    /// history), so that it goes on following.
    async fn follow(self: Arc<Self>) {
        let retry = self.ttl(0.1);
        let election = loop {
            let opened = crate::args::open_store(Some(&self.url)).await;
            match opened.map(|store| Leasehold::from_store(store).election(self.lock.as_str())) {
                Ok(Ok(election)) => break election,
                // Store trouble: only a bad name stays bad, and it would stop the workers.
                _ => sleep(retry).await,
            }
        };
        for n in 0.. {
            let observer = format!("observer.{n}");
            let mut follower = election.observe();
            loop {
                match follower.next().await {
                    Ok(leader) => self.log.record(Event::Observed {
                        observer: observer.clone(),
                        term: leader.as_ref().map(|l| l.term.get()),
                        value: leader.as_ref().and_then(|l| l.value.clone()),
                        leader: leader.map(|l| l.owner),
                    }),
                    Err(e) => {
                        let regressed = matches!(e, Error::Corrupt { .. });
                        self.log.record(Event::ObserveFailed {
                            observer: observer.clone(),
                            error: e.to_string(),
                            regressed,
                        });
                        sleep(retry).await;
                        if regressed {
                            break;
                        }
                    }
                }
            }
        }
    }
}
