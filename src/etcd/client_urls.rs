//! Each member's etcd client URL, as `MemberList` shows it (etcd's `clientURLs`).
//!
//! A node knows only its own etcd listener (`--etcd-listen`); [`own_url`] is its URL: `https`
//! when the client listener has TLS (the etcd listener shares it), else `http`, and the
//! listener's address, with the host of the node's advertised client address when the
//! listener binds every interface (`0.0.0.0`, `[::]`). The node serves that URL in its status
//! document (`ClusterView::etcd_url`: `GET /v1/cluster`, and the peer route `/raft/status`),
//! and [`ClientUrls`] learns the other members' from theirs, over the peer port:
//!
//! - `MemberList` asks, all at once, each member not asked within [`ASK_AGAIN_AFTER`], each ask
//!   bounded by [`ASK_WITHIN`]: the call waits about that long at most, and not at all while
//!   every member's answer is fresh. A member another call is asking counts as asked (its URL
//!   shows once that answer is in). `MemberAdd`, `MemberRemove`, `MemberUpdate` and
//!   `MemberPromote` answer with what is known, without asking.
//! - A member that does not answer (down, partitioned, an older build) keeps the URL it gave
//!   last at the same address, or none if it never answered: its list is empty then, as it
//!   always was before members learned each other's URLs.
//! - Whether a member has answered at all is kept too ([`ClientUrls::answered`]): `MemberList`
//!   lists a learner no one has heard from as not started.
//! - Answers are not trusted: a URL is kept only from the member asked (the document names it)
//!   and only as a bare `http(s)://host:port` of at most [`MAX_URL_BYTES`] ([`checked_url`]).
//!   A member removed, or at another address, is forgotten.
//!
//! # What it must not do
//! Hold its lock across an ask, or let a peer's answer put anything but a checked URL in a
//! `MemberList` answer.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::Clock;
use crate::domain::types::MonoMillis;
use crate::raft::NodeId;
use crate::raft::consensus::ClusterView;
use crate::raft::network::PeerClient;

/// How long one ask for a member's status may take.
pub const ASK_WITHIN: Duration = Duration::from_secs(1);

/// How long a member's answer (or its silence) stands before `MemberList` asks it again.
pub const ASK_AGAIN_AFTER: Duration = Duration::from_secs(5);

/// The longest etcd URL taken from a peer.
pub const MAX_URL_BYTES: usize = 256;

/// The etcd URL of a node whose etcd listener is bound at `bound`, with client TLS or not,
/// advertised to its peers as `advertise` (its client address, `host:port`).
pub fn own_url(tls: bool, bound: SocketAddr, advertise: &str) -> String {
    let scheme = if tls { "https" } else { "http" };
    let advertised_host = advertise
        .rsplit_once(':')
        .map(|(host, _)| host)
        .filter(|host| !host.is_empty());
    match advertised_host {
        Some(host) if bound.ip().is_unspecified() => {
            format!("{scheme}://{host}:{}", bound.port())
        }
        _ => format!("{scheme}://{bound}"),
    }
}

/// `url` as a `MemberList` may show it, if it is one: a bare `http(s)://host:port` (the port
/// may be the scheme's default), at most [`MAX_URL_BYTES`] long; written out in full.
pub fn checked_url(url: &str) -> Option<String> {
    if url.len() > MAX_URL_BYTES {
        return None;
    }
    let parsed = reqwest::Url::parse(url).ok()?;
    if !super::cluster::is_bare(&parsed) {
        return None;
    }
    let host = parsed.host_str().filter(|h| !h.is_empty())?;
    let port = parsed.port_or_known_default().filter(|p| *p > 0)?;
    Some(format!("{}://{host}:{port}", parsed.scheme()))
}

/// What this node learned of one member.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Learned {
    /// The member's address when it was asked.
    address: String,
    /// The etcd URL it gave (its last one, if it has not answered since).
    url: Option<String>,
    /// Whether it has answered as itself at this address (it has started).
    answered: bool,
    /// When it was last asked.
    asked: MonoMillis,
}

/// The members of `view` but this node to ask at `now`, marked asked in `learned`; members
/// `learned` no longer holds (removed, or at another address) are forgotten.
fn due(
    learned: &mut BTreeMap<NodeId, Learned>,
    view: &ClusterView,
    now: MonoMillis,
) -> Vec<(NodeId, String)> {
    learned.retain(|id, l| {
        *id != view.node_id
            && view
                .nodes
                .iter()
                .any(|n| n.id == *id && n.address == l.address)
    });
    let again = ASK_AGAIN_AFTER.as_millis() as u64;
    let mut due = Vec::new();
    for n in view.nodes.iter().filter(|n| n.id != view.node_id) {
        let fresh = learned
            .get(&n.id)
            .is_some_and(|l| now < l.asked.plus(again));
        if !fresh {
            learned
                .entry(n.id)
                .and_modify(|l| l.asked = now)
                .or_insert_with(|| Learned {
                    address: n.address.clone(),
                    url: None,
                    answered: false,
                    asked: now,
                });
            due.push((n.id, n.address.clone()));
        }
    }
    due
}

/// The other members' etcd URLs, learned from their status documents (see the module docs).
pub struct ClientUrls {
    peers: PeerClient,
    clock: Arc<dyn Clock>,
    learned: Mutex<BTreeMap<NodeId, Learned>>,
}

impl ClientUrls {
    pub fn new(peers: PeerClient, clock: Arc<dyn Clock>) -> ClientUrls {
        ClientUrls {
            peers,
            clock,
            learned: Mutex::new(BTreeMap::new()),
        }
    }

    fn learned(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, Learned>> {
        self.learned.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The etcd URL of each member of `view` but this node, as far as this node knows, without
    /// asking.
    pub fn known(&self, view: &ClusterView) -> BTreeMap<NodeId, String> {
        let learned = self.learned();
        view.nodes
            .iter()
            .filter(|n| n.id != view.node_id)
            .filter_map(|n| {
                let l = learned.get(&n.id).filter(|l| l.address == n.address)?;
                Some((n.id, l.url.clone()?))
            })
            .collect()
    }

    /// The members of `view` but this node that have answered this node at their present
    /// address (whether or not they serve an etcd API).
    pub fn answered(&self, view: &ClusterView) -> std::collections::BTreeSet<NodeId> {
        let learned = self.learned();
        view.nodes
            .iter()
            .filter(|n| {
                learned
                    .get(&n.id)
                    .is_some_and(|l| l.address == n.address && l.answered)
            })
            .map(|n| n.id)
            .collect()
    }

    /// [`ClientUrls::known`] after asking the members due (bounded by about [`ASK_WITHIN`]).
    pub async fn refreshed(&self, view: &ClusterView) -> BTreeMap<NodeId, String> {
        let now = self.clock.mono();
        let due = due(&mut self.learned(), view, now);
        if !due.is_empty() {
            let asks = due.into_iter().map(|(id, address)| async move {
                let url = self.ask(id, &address).await;
                (id, address, url)
            });
            // Belt and braces: the client's deadline bounds each ask; this bounds the whole.
            let answers = tokio::time::timeout(
                ASK_WITHIN + Duration::from_millis(200),
                futures::future::join_all(asks),
            )
            .await
            .unwrap_or_default();
            let mut learned = self.learned();
            for (id, address, answer) in answers {
                if let (Some(l), Some(url)) = (learned.get_mut(&id), answer)
                    && l.address == address
                {
                    l.url = url;
                    l.answered = true;
                }
            }
        }
        self.known(view)
    }

    /// Member `id`'s etcd URL (`Some(None)`: it serves none), if it answered in time, as
    /// itself, with a URL that passes [`checked_url`] or none.
    async fn ask(&self, id: NodeId, address: &str) -> Option<Option<String>> {
        let view = self
            .peers
            .status(address, ASK_WITHIN)
            .await
            .map_err(|e| tracing::debug!(peer = id, error = %e, "no etcd URL from the peer"))
            .ok()?;
        if view.node_id != id {
            tracing::debug!(
                peer = id,
                answered = view.node_id,
                "another node answered at the peer's address"
            );
            return None;
        }
        let Some(claimed) = view.etcd_url else {
            return Some(None);
        };
        let url = checked_url(&claimed);
        if url.is_none() {
            tracing::debug!(
                peer = id,
                url = %claimed.chars().take(MAX_URL_BYTES).collect::<String>(),
                "the peer's etcd URL is not a bare http(s)://host:port: ignored"
            );
        }
        Some(url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft::consensus::{MemberNode, MemberStatus};

    #[test]
    fn a_node_names_its_listener_with_its_advertised_host_when_it_binds_every_interface() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert_eq!(
            own_url(false, at("127.0.0.1:2379"), "127.0.0.1:7001"),
            "http://127.0.0.1:2379"
        );
        assert_eq!(
            own_url(true, at("0.0.0.0:2379"), "node-1.example:7001"),
            "https://node-1.example:2379"
        );
        assert_eq!(
            own_url(false, at("[::]:2379"), "[fd00::1]:7001"),
            "http://[fd00::1]:2379"
        );
        // A specific address is the listener's own, whatever is advertised.
        assert_eq!(
            own_url(false, at("[::1]:2379"), "node-1:7001"),
            "http://[::1]:2379"
        );
    }

    #[test]
    fn only_a_bare_http_url_of_a_peer_is_kept() {
        for (claimed, kept) in [
            ("http://127.0.0.1:2379", Some("http://127.0.0.1:2379")),
            (
                "https://node-2.example:2379/",
                Some("https://node-2.example:2379"),
            ),
            ("http://[::1]:2379", Some("http://[::1]:2379")),
            ("http://node-2", Some("http://node-2:80")),
            ("https://node-2:443", Some("https://node-2:443")),
            ("http://node-2:0", None),
            ("ftp://node-2:2379", None),
            ("unix:///run/etcd.sock", None),
            ("javascript:alert(1)", None),
            ("http://user:pw@node-2:2379", None),
            ("http://node-2:2379/path", None),
            ("http://node-2:2379?q", None),
            ("http://node-2:2379#f", None),
            ("http://node-2:99999", None),
            ("node-2:2379", None),
            ("", None),
        ] {
            assert_eq!(checked_url(claimed).as_deref(), kept, "{claimed:?}");
        }
        let long = format!("http://{}.example:2379", "a".repeat(MAX_URL_BYTES));
        assert_eq!(checked_url(&long), None);
    }

    fn view(me: NodeId, nodes: &[(NodeId, &str)]) -> ClusterView {
        ClusterView {
            node_id: me,
            state: "follower".into(),
            leader_id: None,
            term: 1,
            commit_index: 0,
            applied_index: 0,
            last_log_index: 0,
            revision: Default::default(),
            nodes: nodes
                .iter()
                .map(|(id, address)| MemberNode {
                    id: *id,
                    address: address.to_string(),
                    voter: true,
                    status: MemberStatus::default(),
                })
                .collect(),
            ready: true,
            not_ready: None,
            quorum_ack_ms: None,
            etcd_url: None,
        }
    }

    #[test]
    fn members_are_asked_again_only_once_their_answer_is_old() {
        let v = view(1, &[(1, "a:7001"), (2, "b:7002"), (3, "c:7003")]);
        let mut learned = BTreeMap::new();
        let t0 = MonoMillis(1_000);
        assert_eq!(
            due(&mut learned, &v, t0),
            [(2, "b:7002".to_string()), (3, "c:7003".to_string())]
        );
        learned.get_mut(&2).unwrap().url = Some("http://b:2379".into());
        // A concurrent call finds them asked; a later one within the wait too.
        assert!(due(&mut learned, &v, t0).is_empty());
        let again = ASK_AGAIN_AFTER.as_millis() as u64;
        assert!(due(&mut learned, &v, t0.plus(again - 1)).is_empty());
        assert_eq!(due(&mut learned, &v, t0.plus(again)).len(), 2);
        // The URL a member gave stands until it answers otherwise.
        assert_eq!(learned[&2].url.as_deref(), Some("http://b:2379"));

        // A member at another address is asked anew; a removed one is forgotten.
        let moved = view(1, &[(1, "a:7001"), (2, "b:9002")]);
        let later = t0.plus(again + 1);
        assert_eq!(
            due(&mut learned, &moved, later),
            [(2, "b:9002".to_string())]
        );
        assert_eq!(learned[&2].url, None);
        assert!(!learned.contains_key(&3));
    }
}
