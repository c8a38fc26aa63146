//! The etcd API's administration, driven by `etcdctl` 3.4 (see `common::etcdctl`): users,
//! roles and the auth switch on leasecore's auth; membership changes on leasecore's add and
//! remove paths, with new nodes joining through `etcdctl member add`; and the Election
//! service's `Observe` stream (through etcd's gRPC messages and the JSON gateway), beside
//! `etcdctl elect -l` (etcd's client-side recipe); and `MemberList`'s client URLs, one per
//! member, each answering as that member.
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::etcdctl::{
    b64, endpoint, etcd_cluster, etcd_cluster_tweaked, etcdctl_in, fails, have_etcdctl, json, ok,
};
use common::{TestCluster, bind_pair, eventually};
use leasecore::domain::types::NodeId;
use leasecore::node::Node;
use leasecore_etcd_api::etcdserverpb::cluster_client::ClusterClient;
use leasecore_etcd_api::etcdserverpb::lease_client::LeaseClient;
use leasecore_etcd_api::etcdserverpb::maintenance_client::MaintenanceClient;
use leasecore_etcd_api::etcdserverpb::{LeaseGrantRequest, MemberListRequest, StatusRequest};
use leasecore_etcd_api::v3electionpb::election_client::ElectionClient;
use leasecore_etcd_api::v3electionpb::{
    CampaignRequest, LeaderRequest, LeaderResponse, ProclaimRequest, ResignRequest,
};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// Users, roles, permissions and the auth switch, all through etcdctl, with etcd's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_manages_users_roles_and_auth() {
    if !have_etcdctl() {
        return;
    }
    let c = etcd_cluster().await;
    let (e1, e2, e3) = (endpoint(&c, 1), endpoint(&c, 2), endpoint(&c, 3));
    let root = "--user=root:root-pw";

    // Enabling needs a root user; etcdctl then adds the root role itself, as with etcd.
    let err = fails(&e1, &["auth", "enable"]).await;
    assert!(
        err.contains("etcdserver: root user does not exist"),
        "{err}"
    );
    assert_eq!(
        ok(&e1, &["user", "add", "root:root-pw"]).await.trim(),
        "User root created"
    );
    let err = fails(&e2, &["user", "add", "root:again"]).await;
    assert!(
        err.contains("etcdserver: user name already exists"),
        "{err}"
    );
    assert_eq!(
        ok(&e2, &["auth", "enable"]).await.trim(),
        "Authentication Enabled"
    );
    // Without a user: etcd's "user name is empty", which clients do not retry (an invalid
    // token they refresh and retry for seconds); monitoring's status and member list stay
    // open, as etcd's.
    let err = fails(&e3, &["put", "k", "v"]).await;
    assert!(err.contains("etcdserver: user name is empty"), "{err}");
    assert!(
        ok(&e3, &["endpoint", "status"]).await.contains(&e3),
        "status without a user"
    );
    assert_eq!(
        ok(&e3, &["member", "list"]).await.lines().count(),
        3,
        "member list without a user"
    );
    ok(&e3, &[root, "put", "app/x", "1"]).await;

    // A role with a prefix and a key, as etcdctl sends them, and read back the same way.
    ok(&e1, &[root, "role", "add", "reader"]).await;
    ok(
        &e1,
        &[
            root,
            "role",
            "grant-permission",
            "reader",
            "read",
            "app/",
            "--prefix",
        ],
    )
    .await;
    ok(
        &e2,
        &[
            root,
            "role",
            "grant-permission",
            "reader",
            "readwrite",
            "app/own",
        ],
    )
    .await;
    let role = json(&e3, &[root, "role", "get", "reader"]).await;
    let perms: Vec<(String, String, i64)> = role["perm"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                b64(&p["key"]),
                p.get("range_end").map(b64).unwrap_or_default(),
                p.get("permType").and_then(Value::as_i64).unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        perms,
        [
            ("app/".into(), "app0".into(), 0),
            ("app/own".into(), String::new(), 2)
        ],
        "{role}"
    );
    let text = ok(&e1, &[root, "role", "get", "reader"]).await;
    assert!(text.contains("(prefix app/)"), "{text}");
    // Ranges leasecore's grants cannot hold are refused, saying why.
    let err = fails(
        &e1,
        &[root, "role", "grant-permission", "reader", "read", "a", "c"],
    )
    .await;
    assert!(err.contains("one key or on a prefix"), "{err}");
    let err = fails(
        &e1,
        &[
            root,
            "role",
            "grant-permission",
            "reader",
            "read",
            "a",
            "--from-key",
        ],
    )
    .await;
    assert!(err.contains("--from-key"), "{err}");

    ok(&e2, &[root, "user", "add", "alice:alice-pw"]).await;
    assert_eq!(
        ok(&e2, &[root, "user", "grant-role", "alice", "reader"])
            .await
            .trim(),
        "Role reader is granted to user alice"
    );
    assert_eq!(
        ok(&e3, &[root, "user", "get", "alice"]).await,
        "User: alice\nRoles: reader\n"
    );
    let users = ok(&e1, &[root, "user", "list"]).await;
    assert_eq!(users.lines().collect::<Vec<_>>(), ["alice", "root"]);
    let roles = ok(&e1, &[root, "role", "list"]).await;
    assert_eq!(roles.lines().collect::<Vec<_>>(), ["reader", "root"]);

    // Alice reads under app/, writes app/own only, and administers nothing.
    let alice = "--user=alice:alice-pw";
    assert_eq!(ok(&e2, &[alice, "get", "app/x"]).await, "app/x\n1\n");
    let err = fails(&e2, &[alice, "put", "app/x", "2"]).await;
    assert!(err.contains("etcdserver: permission denied"), "{err}");
    ok(&e3, &[alice, "put", "app/own", "mine"]).await;
    let err = fails(&e3, &[alice, "user", "list"]).await;
    assert!(err.contains("etcdserver: permission denied"), "{err}");
    let err = fails(
        &e3,
        &[
            alice,
            "member",
            "add",
            "x",
            "--peer-urls=http://127.0.0.1:9999",
        ],
    )
    .await;
    assert!(err.contains("etcdserver: permission denied"), "{err}");

    // etcd's errors, word for word.
    for (args, want) in [
        (
            vec!["user", "get", "bob"],
            "etcdserver: user name not found",
        ),
        (
            vec!["role", "get", "nope"],
            "etcdserver: role name not found",
        ),
        (
            vec!["role", "add", "reader"],
            "etcdserver: role name already exists",
        ),
        (
            vec!["user", "grant-role", "alice", "nope"],
            "etcdserver: role name not found",
        ),
        (
            vec!["user", "revoke-role", "alice", "root"],
            "etcdserver: role is not granted to the user",
        ),
        (
            vec!["role", "revoke-permission", "reader", "zzz"],
            "etcdserver: permission is not granted to the role",
        ),
        (
            vec!["role", "revoke-permission", "reader", "a", "c"],
            "etcdserver: permission is not granted to the role",
        ),
        (
            vec!["user", "delete", "root"],
            "etcdserver: invalid auth management",
        ),
        (
            vec!["user", "revoke-role", "root", "root"],
            "etcdserver: invalid auth management",
        ),
        (
            vec!["role", "delete", "root"],
            "etcdserver: invalid auth management",
        ),
    ] {
        let mut all = vec![root];
        all.extend(args.iter().copied());
        let err = fails(&e1, &all).await;
        assert!(err.contains(want), "{args:?}: {err}");
    }

    // A new password: the old one stops working, the new one works.
    let changed = etcdctl_in(
        &e1,
        &[root, "user", "passwd", "alice", "--interactive=false"],
        "alice-new\n",
    )
    .await;
    assert!(changed.status.success(), "{changed:?}");
    let err = fails(&e2, &[alice, "get", "app/x"]).await;
    assert!(err.contains("authentication failed"), "{err}");
    let alice = "--user=alice:alice-new";
    ok(&e2, &[alice, "get", "app/x"]).await;

    // Revoking the prefix takes the reads away; the key grant stays.
    ok(
        &e3,
        &[
            root,
            "role",
            "revoke-permission",
            "reader",
            "app/",
            "--prefix",
        ],
    )
    .await;
    let err = fails(&e1, &[alice, "get", "app/x"]).await;
    assert!(err.contains("permission denied"), "{err}");
    assert_eq!(ok(&e1, &[alice, "get", "app/own"]).await, "app/own\nmine\n");
    // Maintenance is root's, as etcd's.
    for cmd in [&["defrag"][..], &["endpoint", "hashkv"][..]] {
        let err = fails(&e1, &[&[alice][..], cmd].concat()).await;
        assert!(err.contains("permission denied"), "{cmd:?}: {err}");
    }
    ok(&e1, &[root, "endpoint", "hashkv"]).await;

    // The gateway: a token from /v3/auth/authenticate, then status and the user list.
    let http = reqwest::Client::new();
    let base = format!("http://{e2}");
    let auth: Value = http
        .post(format!("{base}/v3/auth/authenticate"))
        .json(&serde_json::json!({"name": "root", "password": "root-pw"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = auth["token"].as_str().expect("a token").to_string();
    let post = |path: &str| {
        http.post(format!("{base}{path}"))
            .header("authorization", token.clone())
            .body("{}")
    };
    // The status is open (as `GET /v1/auth/status`): it says whether a token is needed.
    let status: Value = http
        .post(format!("{base}/v3/auth/status"))
        .body("{}")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["enabled"], true, "{status}");
    assert!(status["authRevision"].as_str().is_some(), "{status}");
    let users: Value = post("/v3/auth/user/list")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(users["users"], serde_json::json!(["alice", "root"]));
    // Without a token: etcd's gateway answers "user name is empty" as a bad request.
    let denied = http
        .post(format!("{base}/v3/auth/role/list"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status(), 400);
    let body: Value = denied.json().await.unwrap();
    assert_eq!(body["code"], 3, "{body}");

    // Cleaning up, then auth off: anyone writes again.
    ok(&e1, &[root, "user", "revoke-role", "alice", "reader"]).await;
    ok(&e1, &[root, "role", "delete", "reader"]).await;
    ok(&e1, &[root, "user", "delete", "alice"]).await;
    assert_eq!(
        ok(&e2, &[root, "auth", "disable"]).await.trim(),
        "Authentication Disabled"
    );
    ok(&e3, &["put", "open", "again"]).await;
    assert_eq!(
        ok(&e1, &["user", "list"]).await.lines().collect::<Vec<_>>(),
        ["root"]
    );
    c.shutdown().await;
}

/// The root role is deleted as etcd deletes it: refused while auth is on (`invalid auth
/// management`); with auth off really deleted, gone from the role list and from its holder,
/// and a second delete is `role name not found` (leasecore answered success and kept
/// listing it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_deletes_the_root_role_only_with_auth_off() {
    if !have_etcdctl() {
        return;
    }
    let c = etcd_cluster().await;
    let (e1, e2) = (endpoint(&c, 1), endpoint(&c, 2));
    let root = "--user=root:root-pw";
    ok(&e1, &["user", "add", "root:root-pw"]).await;
    ok(&e1, &["role", "add", "root"]).await;
    ok(&e1, &["user", "grant-role", "root", "root"]).await;
    ok(&e1, &["auth", "enable"]).await;
    let err = fails(&e2, &[root, "role", "delete", "root"]).await;
    assert!(
        err.lines()
            .any(|l| l == "Error: etcdserver: invalid auth management"),
        "{err}"
    );
    let roles = ok(&e2, &[root, "role", "list"]).await;
    assert_eq!(roles.lines().collect::<Vec<_>>(), ["root"]);
    ok(&e2, &[root, "auth", "disable"]).await;

    assert_eq!(
        ok(&e1, &["role", "delete", "root"]).await.trim(),
        "Role root deleted"
    );
    for e in [&e1, &e2] {
        let roles = ok(e, &["role", "list"]).await;
        assert_eq!(roles, "", "through {e}: {roles}");
        let user = json(e, &["user", "get", "root"]).await;
        assert_eq!(user.get("roles"), None, "through {e}: {user}");
    }
    let err = fails(&e2, &["role", "delete", "root"]).await;
    assert!(
        err.lines()
            .any(|l| l == "Error: etcdserver: role name not found"),
        "{err}"
    );
    c.shutdown().await;
}

/// `etcdctl member list`'s line for member `id` through `ep`.
async fn member_line(ep: &str, id: u64) -> String {
    let list = ok(ep, &["member", "list"]).await;
    let prefix = format!("{id:x}, ");
    list.lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("member {id:x} is not listed: {list}"))
        .to_string()
}

/// A member added but not started is listed as etcd lists it: without a name or client URLs,
/// which etcdctl shows as `unstarted` (leasecore listed it `started`, named `node-N`),
/// through the leader and a follower alike. Once started it is listed with its name and
/// client URL, and still after it stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_added_but_not_started_is_listed_unstarted() {
    if !have_etcdctl() {
        return;
    }
    let mut c = etcd_cluster().await;
    let leader = c.leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let (el, ef) = (endpoint(&c, leader), endpoint(&c, follower));
    let four = bind_pair().await;
    let addr4 = four.0.local_addr().unwrap().to_string();
    let url4 = peer_url_of(&addr4);
    assert_eq!(added_id(&add_learner(&el, "n4", &url4).await), 4);
    for e in [&el, &ef] {
        assert_eq!(
            member_line(e, 4).await,
            format!("4, unstarted, , {url4}, , true"),
            "through {e}"
        );
    }
    // The gateway's JSON leaves the empty name and URLs out, as etcd's.
    let list: Value = reqwest::Client::new()
        .post(format!("http://{ef}/v3/cluster/member/list"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let four_json = list["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["ID"] == "4")
        .cloned()
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(
        (four_json.get("name"), four_json.get("clientURLs")),
        (None, None),
        "{four_json}"
    );

    c.addrs.insert(4, addr4);
    start_joiner_on(&mut c, 4, four).await;
    let started = format!(
        "4, started, node-4, {url4}, http://{}, true",
        endpoint(&c, 4)
    );
    for e in [&el, &ef] {
        eventually(
            Duration::from_secs(20),
            "node 4 to be listed started",
            || {
                let (e, started) = (e.clone(), started.clone());
                async move { (member_line(&e, 4).await == started).then_some(()) }
            },
        )
        .await;
    }
    c.stop(4).await;
    for e in [&el, &ef] {
        assert_eq!(member_line(e, 4).await, started, "through {e}, stopped");
    }
    c.shutdown().await;
}

/// `member promote` of a learner that is not in sync fails at once with etcd's error, through
/// the leader or a follower, even with a catch-up wait longer than etcdctl's 5 s command
/// timeout (leasecore's add path would wait for it: etcdctl then said only "context deadline
/// exceeded").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn promoting_a_learner_that_is_not_in_sync_fails_at_once() {
    if !have_etcdctl() {
        return;
    }
    let c = etcd_cluster_tweaked(|cfg| cfg.catch_up_ms = 30_000).await;
    let e1 = endpoint(&c, 1);
    let four = bind_pair().await;
    let url4 = peer_url_of(&four.0.local_addr().unwrap().to_string());
    let out = add_learner(&e1, "n4", &url4).await;
    assert_eq!(added_id(&out), 4, "{out}");
    let leader = c.leader().await;
    for id in [leader, (1..=3).find(|i| *i != leader).unwrap()] {
        let err = fails(&endpoint(&c, id), &["member", "promote", "4"]).await;
        assert!(
            err.contains("can only promote a learner member which is in sync with leader"),
            "through node {id}: {err}"
        );
    }
    c.shutdown().await;
}

/// `etcdctl member add NAME --learner --peer-urls=URL` through `ep`: its output.
async fn add_learner(ep: &str, name: &str, url: &str) -> String {
    let urls = format!("--peer-urls={url}");
    ok(ep, &["member", "add", name, "--learner", &urls]).await
}

/// The peer URL etcdctl names a new node by: its client port + 1000.
fn peer_url_of(addr: &str) -> String {
    let peer = leasecore::domain::resources::peer_address(addr).unwrap();
    format!("http://{peer}")
}

/// Start node `id` on `listeners` (bound earlier, before `etcdctl member add` named them),
/// as a node waiting to be added, with an etcd listener.
async fn start_joiner_on(
    c: &mut TestCluster,
    id: NodeId,
    listeners: (tokio::net::TcpListener, tokio::net::TcpListener),
) {
    let node = Node::start_on_both(c.config(id, true), listeners.0, listeners.1)
        .await
        .unwrap();
    c.nodes.insert(id, node);
}

/// `etcdctl member list`'s members: id, whether a learner, peer URLs.
async fn members(ep: &str) -> Vec<(u64, bool, Vec<String>)> {
    let list = json(ep, &["member", "list"]).await;
    list["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let urls = m["peerURLs"]
                .as_array()
                .map(|a| a.iter().map(|u| u.as_str().unwrap().to_string()).collect())
                .unwrap_or_default();
            (
                m["ID"].as_u64().unwrap(),
                m.get("isLearner").and_then(Value::as_bool).unwrap_or(false),
                urls,
            )
        })
        .collect()
}

/// The member id `etcdctl member add` printed (`Member <hex id> added to cluster ...`).
fn added_id(out: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.starts_with("Member "))
        .unwrap_or_else(|| panic!("no Member line in {out}"));
    let hex = line.split_whitespace().nth(1).unwrap();
    u64::from_str_radix(hex, 16).unwrap()
}

/// etcd's membership flows with etcdctl: a learner added, started (a real leasecore node
/// joining), promoted; a voter added before it runs, started, and promoted by itself; updates
/// and removals; etcd's errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcdctl_adds_promotes_and_removes_members() {
    if !have_etcdctl() {
        return;
    }
    // A short catch-up wait, so that adding a voter that is not running yet answers well
    // within etcdctl's command timeout.
    let mut c = etcd_cluster_tweaked(|cfg| cfg.catch_up_ms = 2_000).await;
    let e1 = endpoint(&c, 1);

    // A learner, added before it runs.
    let four = bind_pair().await;
    let addr4 = four.0.local_addr().unwrap().to_string();
    let url4 = peer_url_of(&addr4);
    let out = add_learner(&e1, "n4", &url4).await;
    let id4 = added_id(&out);
    assert_eq!(id4, 4, "the next id after the highest: {out}");
    assert!(
        out.contains(&format!("n4={url4}")) && out.contains("ETCD_INITIAL_CLUSTER_STATE"),
        "{out}"
    );
    let e2 = endpoint(&c, 2);
    eventually(
        Duration::from_secs(10),
        "node 2 to list the learner",
        || {
            let (e2, url4) = (e2.clone(), url4.clone());
            async move {
                members(&e2)
                    .await
                    .contains(&(4, true, vec![url4]))
                    .then_some(())
            }
        },
    )
    .await;
    let err = fails(
        &e1,
        &["member", "add", "again", &format!("--peer-urls={url4}")],
    )
    .await;
    assert!(
        err.contains("etcdserver: Peer URLs already exists"),
        "{err}"
    );
    // Not running: it cannot be in sync.
    let err = fails(&e2, &["member", "promote", "4"]).await;
    assert!(
        err.contains("can only promote a learner member which is in sync with leader"),
        "{err}"
    );

    // It starts, joins and catches up; stays a learner until promoted.
    c.addrs.insert(4, addr4.clone());
    start_joiner_on(&mut c, 4, four).await;
    let e4 = endpoint(&c, 4);
    ok(&e1, &["put", "joined", "yes"]).await;
    eventually(Duration::from_secs(20), "node 4 to catch up", || {
        let e4 = e4.clone();
        async move {
            let out = etcdctl_in(&e4, &["get", "joined", "--consistency=s"], "").await;
            (String::from_utf8_lossy(&out.stdout) == "joined\nyes\n").then_some(())
        }
    })
    .await;
    assert!(members(&e1).await.contains(&(4, true, vec![url4.clone()])));
    let promoted = ok(&e4, &["member", "promote", "4"]).await;
    assert!(promoted.contains("promoted"), "{promoted}");
    assert!(members(&e2).await.contains(&(4, false, vec![url4.clone()])));
    let err = fails(&e1, &["member", "promote", "4"]).await;
    assert!(
        err.contains("etcdserver: can only promote a learner member"),
        "{err}"
    );

    // A voter, added before it runs: a learner until it has started and caught up, then a
    // voter by itself (no promote).
    let five = bind_pair().await;
    let addr5 = five.0.local_addr().unwrap().to_string();
    let url5 = peer_url_of(&addr5);
    let added = json(
        &e2,
        &["member", "add", "n5", &format!("--peer-urls={url5}")],
    )
    .await;
    assert_eq!(added["member"]["ID"].as_u64(), Some(5), "{added}");
    assert_eq!(added["members"].as_array().unwrap().len(), 5, "{added}");
    c.addrs.insert(5, addr5);
    start_joiner_on(&mut c, 5, five).await;
    eventually(Duration::from_secs(30), "node 5 to become a voter", || {
        let e1 = e1.clone();
        let url5 = url5.clone();
        async move {
            members(&e1)
                .await
                .contains(&(5, false, vec![url5]))
                .then_some(())
        }
    })
    .await;
    // The five nodes answer as one cluster.
    ok(&endpoint(&c, 5), &["put", "five", "5"]).await;
    assert_eq!(ok(&e4, &["get", "five"]).await, "five\n5\n");

    // Update: the same address is fine, another is refused (leasecore cannot move a node).
    let updated = ok(
        &e1,
        &["member", "update", "4", &format!("--peer-urls={url4}")],
    )
    .await;
    assert!(updated.contains("updated"), "{updated}");
    let err = fails(
        &e1,
        &["member", "update", "4", "--peer-urls=http://127.0.0.1:9999"],
    )
    .await;
    assert!(err.contains("cannot move a member"), "{err}");
    let err = fails(
        &e1,
        &["member", "update", "63", &format!("--peer-urls={url4}")],
    )
    .await;
    assert!(err.contains("etcdserver: member not found"), "{err}");
    // A peer port leasecore cannot derive a client port from, and one URL too many.
    let err = fails(
        &e1,
        &["member", "add", "x", "--peer-urls=http://127.0.0.1:999"],
    )
    .await;
    assert!(err.contains("above 1000"), "{err}");
    let err = fails(
        &e1,
        &[
            "member",
            "add",
            "x",
            "--peer-urls=http://127.0.0.1:9001,http://127.0.0.1:9002",
        ],
    )
    .await;
    assert!(err.contains("exactly one peer URL"), "{err}");

    // Removal, back to three.
    for id in [5, 4] {
        let out = ok(&e1, &["member", "remove", &format!("{id:x}")]).await;
        assert!(out.contains("removed"), "{out}");
    }
    let err = fails(&e1, &["member", "remove", "4"]).await;
    assert!(err.contains("etcdserver: member not found"), "{err}");
    eventually(
        Duration::from_secs(10),
        "node 2 to list three members",
        || {
            let e2 = e2.clone();
            async move {
                let left: Vec<u64> = members(&e2).await.iter().map(|m| m.0).collect();
                (left == [1, 2, 3]).then_some(())
            }
        },
    )
    .await;
    c.shutdown().await;
}

/// `MemberList` through one node names every member's etcd client URL (each node learns the
/// others' from their status documents), and each URL answers etcd's `Status` as that member:
/// what clients that find their endpoints in the member list need (`etcdctl endpoint status
/// --cluster`, clientv3's auto-sync). `GET /v1/cluster` names the answering node's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn member_list_names_every_members_client_url() {
    let c = etcd_cluster().await;
    let mut cluster = ClusterClient::connect(format!("http://{}", endpoint(&c, 1)))
        .await
        .unwrap();
    let members = cluster
        .member_list(MemberListRequest::default())
        .await
        .unwrap()
        .into_inner()
        .members;
    let ids: Vec<u64> = members.iter().map(|m| m.id).collect();
    assert_eq!(ids, [1, 2, 3]);
    for m in &members {
        assert_eq!(
            m.client_ur_ls,
            [format!("http://{}", endpoint(&c, m.id))],
            "member {}",
            m.id
        );
        let mut maintenance = MaintenanceClient::connect(m.client_ur_ls[0].clone())
            .await
            .unwrap();
        let status = maintenance
            .status(StatusRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(status.header.unwrap().member_id, m.id);
    }
    for id in [1, 2, 3] {
        let view: Value = reqwest::get(format!("{}/v1/cluster", c.url(id)))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            view["etcd_url"],
            format!("http://{}", endpoint(&c, id)),
            "{view}"
        );
    }
    // etcdctl through another node shows them too. (Not `endpoint status --cluster`:
    // etcdctl 3.4 dials each URL with the whole URL as the HTTP/2 `:authority`, which the h2
    // server refuses as malformed, whoever lists the URL.)
    if have_etcdctl() {
        let list = json(&endpoint(&c, 2), &["member", "list"]).await;
        let listed: Vec<(u64, Value)> = list["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m["ID"].as_u64().unwrap(), m["clientURLs"].clone()))
            .collect();
        let expected: Vec<(u64, Value)> = [1, 2, 3]
            .into_iter()
            .map(|id| {
                (
                    id,
                    serde_json::json!([format!("http://{}", endpoint(&c, id))]),
                )
            })
            .collect();
        assert_eq!(listed, expected, "{list}");
    }
    // With auth on, the members still learn each other's URLs: the peer status route asks
    // for no token (peers hold none).
    let anon = c.client();
    anon.user_add("root", "root-pw").await.unwrap();
    anon.user_grant_role("root", "root").await.unwrap();
    anon.auth_enable().await.unwrap();
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(10), "node 3 to ask for a token", || {
        let (http, url) = (http.clone(), format!("{}/v1/cluster", c.url(3)));
        async move {
            let status = http.get(url).send().await.ok()?.status();
            (status == reqwest::StatusCode::UNAUTHORIZED).then_some(())
        }
    })
    .await;
    let peer_view: Value = http
        .post(format!("{}/raft/status", c.peer_url(3)))
        .json(&())
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        peer_view["etcd_url"],
        format!("http://{}", endpoint(&c, 3)),
        "{peer_view}"
    );
    c.shutdown().await;
}

/// The next answer of an Observe stream, within a deadline.
async fn next_leader(stream: &mut tonic::Streaming<LeaderResponse>) -> (String, String, i64) {
    let (key, value, revision, _) = next_leader_version(stream).await;
    (key, value, revision)
}

/// The same, with the key's version (etcd's answer carries it: 1, then one more per
/// proclamation).
async fn next_leader_version(
    stream: &mut tonic::Streaming<LeaderResponse>,
) -> (String, String, i64, i64) {
    let resp = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("an Observe answer within 10 s")
        .expect("the stream stays healthy")
        .expect("the stream stays open");
    let kv = resp.kv.expect("the leader's key");
    (
        String::from_utf8(kv.key).unwrap(),
        String::from_utf8(kv.value).unwrap(),
        kv.create_revision,
        kv.version,
    )
}

/// `Observe` sends the leader at once, then each change (a proclaimed value, a new leader);
/// nothing while there is none. And `etcdctl elect -l` (etcd's client-side recipe) follows
/// `etcdctl elect`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn observe_streams_the_leader_and_each_change() {
    if !have_etcdctl() {
        return;
    }
    let c = etcd_cluster().await;
    let (e1, e2, e3) = (endpoint(&c, 1), endpoint(&c, 2), endpoint(&c, 3));
    let leases = LeaseClient::connect(format!("http://{e1}")).await.unwrap();
    let grant = || {
        let mut l = leases.clone();
        async move {
            l.lease_grant(LeaseGrantRequest { ttl: 60, id: 0 })
                .await
                .unwrap()
                .into_inner()
                .id
        }
    };
    let (a, b) = (grant().await, grant().await);
    let mut candidates = ElectionClient::connect(format!("http://{e1}"))
        .await
        .unwrap();
    let mut watcher = ElectionClient::connect(format!("http://{e2}"))
        .await
        .unwrap();

    // No leader yet: the stream stays silent until the first campaigner leads.
    let mut stream = watcher
        .observe(LeaderRequest {
            name: b"pick".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), stream.message())
            .await
            .is_err(),
        "nothing while there is no leader"
    );
    let led = candidates
        .campaign(CampaignRequest {
            name: b"pick".to_vec(),
            lease: a,
            value: b"alpha".to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
        .leader
        .unwrap();
    let (key_a, value, rev_a, version) = next_leader_version(&mut stream).await;
    assert_eq!((value.as_str(), rev_a, version), ("alpha", led.rev, 1));
    // etcd's layout: `<name>/<lease id in hex>`.
    assert_eq!(key_a, format!("pick/{:x}", led.lease), "{key_a}");

    // A second observer gets the current leader at once.
    let mut late = ElectionClient::connect(format!("http://{e3}"))
        .await
        .unwrap()
        .observe(LeaderRequest {
            name: b"pick".to_vec(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next_leader(&mut late).await.1, "alpha");

    // A second candidate queues (which is no change of leader), then the leader proclaims.
    let mut second = candidates.clone();
    let queued = tokio::spawn(async move {
        second
            .campaign(CampaignRequest {
                name: b"pick".to_vec(),
                lease: b,
                value: b"beta".to_vec(),
            })
            .await
    });
    candidates
        .proclaim(ProclaimRequest {
            leader: Some(led.clone()),
            value: b"alpha-2".to_vec(),
        })
        .await
        .unwrap();
    let (key, value, _, version) = next_leader_version(&mut stream).await;
    assert_eq!(
        (key.as_str(), value.as_str(), version),
        (key_a.as_str(), "alpha-2", 2)
    );

    // The leader resigns: the queued candidate leads, and the stream says so.
    candidates
        .resign(ResignRequest { leader: Some(led) })
        .await
        .unwrap();
    let (key_b, value, rev_b) = next_leader(&mut stream).await;
    assert_eq!(value, "beta");
    assert!(key_b != key_a && rev_b > rev_a);
    let won = queued.await.unwrap().unwrap().into_inner().leader.unwrap();
    assert_eq!(won.rev, rev_b);
    // The late observer saw the same changes, though it may have read once for both.
    let mut value = next_leader(&mut late).await.1;
    if value == "alpha-2" {
        value = next_leader(&mut late).await.1;
    }
    assert_eq!(value, "beta");

    // A bad name (an empty one: etcd's layout takes any other) is the call's own error.
    let err = watcher
        .observe(LeaderRequest { name: Vec::new() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");

    // The gateway's stream: one {"result": ...} line per answer, the current leader first.
    let http = reqwest::Client::new();
    let mut resp = http
        .post(format!("http://{e3}/v3/election/observe"))
        .json(&serde_json::json!({"name": "cGljaw=="}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = Vec::new();
    while !body.contains(&b'\n') {
        let chunk = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
            .await
            .expect("a gateway line within 10 s")
            .unwrap()
            .expect("the stream stays open");
        body.extend_from_slice(&chunk);
    }
    let first: Value =
        serde_json::from_slice(&body[..body.iter().position(|b| *b == b'\n').unwrap()]).unwrap();
    assert_eq!(b64(&first["result"]["kv"]["value"]), "beta", "{first}");
    drop(resp);

    // etcdctl's own recipe: `elect -l` prints the leader `elect` made, then the next one.
    let listen = |ep: &str| {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={ep}"))
            .args(["elect", "-l", "ballot"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let campaign = |ep: &str, value: &str| {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={ep}"))
            .args(["elect", "ballot", value])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    };
    let mut first_candidate = campaign(&e1, "one");
    let mut elected = BufReader::new(first_candidate.stdout.take().unwrap()).lines();
    let key = tokio::time::timeout(Duration::from_secs(10), elected.next_line())
        .await
        .expect("elected")
        .unwrap()
        .unwrap();
    assert!(key.starts_with("ballot/"), "{key}");
    let mut listener = listen(&e2);
    let mut lines = BufReader::new(listener.stdout.take().unwrap()).lines();
    let mut next_line = async || {
        tokio::time::timeout(Duration::from_secs(10), lines.next_line())
            .await
            .expect("a leader line within 10 s")
            .unwrap()
            .expect("the listener stays up")
    };
    assert_eq!(
        (next_line().await, next_line().await),
        (key.clone(), "one".into())
    );
    let mut second_candidate = campaign(&e3, "two");
    let mut second_out = BufReader::new(second_candidate.stdout.take().unwrap()).lines();
    // The first leader resigns (etcdctl does on an interrupt); the second leads; the
    // listener follows.
    let pid = first_candidate.id().unwrap().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-INT", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    let key2 = tokio::time::timeout(Duration::from_secs(10), second_out.next_line())
        .await
        .expect("the second candidate leads once the first's lease is gone")
        .unwrap()
        .unwrap();
    assert_eq!((next_line().await, next_line().await), (key2, "two".into()));
    c.shutdown().await;
}

/// A member added with the address of a server that answers, but not as a peer does (here a
/// 404 with a body, as an etcd port answers an unknown path), is retried with a backoff, as an
/// unreachable one is: the leader resent to it thousands of times a second, a whole core,
/// until the member was removed. Counted at the fake peer over two seconds once the first
/// request came: a backoff's pace is a few a second, the loop's was thousands.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_at_a_foreign_server_is_retried_with_a_backoff() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tokio::io::AsyncWriteExt;

    if !have_etcdctl() {
        return;
    }
    let c = etcd_cluster().await;
    let e1 = endpoint(&c, 1);
    let (client, peer) = bind_pair().await;
    let url = peer_url_of(&client.local_addr().unwrap().to_string());
    drop(client);
    // Every request on every connection: read it, answer 404 with a body, keep the
    // connection (as an HTTP/1.1 server does).
    let requests = Arc::new(AtomicU64::new(0));
    let counted = requests.clone();
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = peer.accept().await else {
                return;
            };
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    match tokio::time::timeout(
                        Duration::from_secs(30),
                        tokio::io::AsyncReadExt::read(&mut sock, &mut buf),
                    )
                    .await
                    {
                        Ok(Ok(n)) if n > 0 => {}
                        _ => return,
                    }
                    counted.fetch_add(1, Ordering::Relaxed);
                    let body = "{\"error\":\"not found\"}";
                    let answer = format!(
                        "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if sock.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let out = add_learner(&e1, "foreign", &url).await;
    let id = added_id(&out);
    eventually(
        Duration::from_secs(20),
        "the leader reaches the member",
        || {
            let requests = requests.clone();
            async move { (requests.load(Ordering::Relaxed) > 0).then_some(()) }
        },
    )
    .await;
    let before = requests.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let sent = requests.load(Ordering::Relaxed) - before;
    ok(&e1, &["member", "remove", &format!("{id:x}")]).await;
    server.abort();
    assert!(
        sent < 100,
        "the leader sent {sent} requests in 2 s to a member that answers 404"
    );
    c.shutdown().await;
}
