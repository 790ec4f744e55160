//! The one list of URL forms: messages, the CLI's `--store` help and the README's table
//! (a CLI test holds the README to it) all print it.

/// One way to write a store URL, and what it opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UrlForm {
    /// How it is written, e.g. `etcd://h1:2379[,h2:2379...]`.
    pub form: &'static str,
    /// What it opens; names and examples in backticks (Markdown).
    pub store: &'static str,
}

/// Every URL form this library reads, in the order the docs list them.
pub const URL_FORMS: &[UrlForm] = &[
    UrlForm {
        form: "local:",
        store: "the local store in its default directory: `$LEASEHOLD_HOME`, else `$XDG_STATE_HOME/leasehold`, else `~/.local/state/leasehold` (the CLI's default)",
    },
    UrlForm {
        form: "local:DIR",
        store: "the local store in `DIR` (created if missing): `local:/srv/locks` (absolute), `local:locks` (relative to the working directory), `local:~/locks` (in the home directory); `%XX` escapes are decoded (`%20` a space, `%25` a `%`)",
    },
    UrlForm {
        form: "local:///DIR",
        store: "the same, file-URL form: `local:///srv/locks` is `/srv/locks`. `local://srv/locks` is refused: in URL syntax `srv` is a host",
    },
    UrlForm {
        form: "memory:",
        store: "this process only; each `connect(\"memory:\")` is a store of its own, so clone one `Leasehold` to share its locks",
    },
    UrlForm {
        form: "redis://[user:password@]host:port[/db]",
        store: "a Redis server; `%XX` escapes in the user and password (`%40` for `@`)",
    },
    UrlForm {
        form: "rediss://...",
        store: "Redis over TLS (rustls; system root certificates, or those in `SSL_CERT_FILE`); `#insecure` at the end accepts any server certificate (no CA or host name check: for tests only)",
    },
    UrlForm {
        form: "redis+cluster://[user:password@]h1:p1,h2:p2",
        store: "a Redis Cluster, from any seed nodes (`rediss+cluster://` for TLS)",
    },
    UrlForm {
        form: "redis://...?durable=1",
        store: "refuse a server whose restart or failover can lose locks (no `appendonly yes` with `appendfsync always`, or replicas without `?replicas`)",
    },
    UrlForm {
        form: "redis://...?replicas=N&replica_timeout=100ms",
        store: "a grant counts only once N replicas have it (`WAIT`); else it is given back and the attempt fails as unavailable. One server only",
    },
    UrlForm {
        form: "redis://...?protocol=resp3",
        store: "talk RESP3 to the server (default `resp2`)",
    },
    UrlForm {
        form: "etcd://h1:2379[,h2:2379...]",
        store: "an etcd cluster (any members; calls fail over between them); locks are fair by default",
    },
    UrlForm {
        form: "etcd://...?user=NAME&password=SECRET",
        store: "etcd with authentication; `%XX` escapes in both (`%26` for `&`)",
    },
    UrlForm {
        form: "etcds://...",
        store: "etcd over TLS (rustls; system root certificates or `SSL_CERT_FILE`)",
    },
];

/// The forms on one line, for messages.
pub(super) fn line() -> String {
    let forms: Vec<&str> = URL_FORMS.iter().map(|f| f.form).collect();
    forms.join(", ")
}
