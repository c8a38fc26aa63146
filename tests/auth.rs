//! Authentication and authorization end to end, modelled on etcd's tests/common/auth_test.go:
//! enabling, tokens, roles on keys and prefixes, and every route family's check.
#![allow(clippy::disallowed_methods)] // tests wait against real deadlines

use crate::common;
use crate::support;

use std::time::Duration;

use common::{TestCluster, eventually};
use leasecore::client::{Client, ClientError};
use leasecore::domain::auth::PermKind::{Read, Readwrite, Write};
use reqwest::Method;
use serde_json::json;
use support::{ROOT_PASSWORD, assert_error, enable_auth, raw, user_with};

fn code(e: &ClientError) -> &str {
    e.code().unwrap_or("(no answer)")
}

async fn one_node() -> TestCluster {
    let c = TestCluster::start(1).await;
    c.leader().await;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn enabling_needs_a_root_user_holding_the_root_role() {
    let c = one_node().await;
    let anon = c.client();
    let e = anon.auth_enable().await.unwrap_err();
    assert_eq!((e.status(), code(&e)), (Some(409), "root_user_required"));
    anon.user_add("root", ROOT_PASSWORD).await.unwrap();
    let e = anon.auth_enable().await.unwrap_err();
    assert_eq!(code(&e), "root_user_required", "root without the root role");
    anon.user_grant_role("root", "root").await.unwrap();
    assert!(anon.auth_enable().await.unwrap().enabled);
    assert!(anon.auth_status().await.unwrap().enabled, "status is open");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_auth_on_every_client_route_needs_a_token() {
    let c = one_node().await;
    enable_auth(&c).await;
    let base = c.url(1);
    for (method, path, body) in [
        (Method::GET, "/v1/kv/a", None),
        (Method::PUT, "/v1/kv/a", Some(json!({"value": "v"}))),
        (Method::DELETE, "/v1/kv/a", None),
        (Method::GET, "/v1/kv?prefix=", None),
        (
            Method::POST,
            "/v1/leases",
            Some(json!({"name": "l", "ttl_ms": 5000})),
        ),
        (Method::GET, "/v1/leases", None),
        (Method::GET, "/v1/watch?timeout_ms=0", None),
        (Method::GET, "/v1/members", None),
        (Method::GET, "/v1/cluster", None),
        (Method::GET, "/v1/snapshot", None),
        (Method::GET, "/v1/flease/r", None),
        (Method::GET, "/v1/auth/users", None),
        (Method::POST, "/v1/auth/disable", None),
    ] {
        let url = format!("{base}{path}");
        let answer = raw(method.clone(), &url, None, body.clone()).await;
        assert_error(&answer, 401, "unauthenticated");
        let answer = raw(method, &url, Some("not.a-token"), body).await;
        assert_error(&answer, 401, "unauthenticated");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_readiness_metrics_and_auth_status_stay_open() {
    let c = one_node().await;
    enable_auth(&c).await;
    for path in ["/health", "/livez", "/readyz", "/v1/auth/status"] {
        let (status, _) = raw(Method::GET, &format!("{}{path}", c.url(1)), None, None).await;
        assert_eq!(status, 200, "{path}");
    }
    let metrics = reqwest::get(format!("{}/metrics", c.url(1))).await.unwrap();
    assert_eq!(metrics.status(), 200);
    let text = metrics.text().await.unwrap();
    assert!(!text.contains(ROOT_PASSWORD), "no secret in metrics");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wrong_password_or_unknown_user_is_401_without_saying_which() {
    let c = one_node().await;
    enable_auth(&c).await;
    let url = format!("{}/v1/auth/authenticate", c.url(1));
    let wrong = raw(
        Method::POST,
        &url,
        None,
        Some(json!({"name": "root", "password": "nope-pw"})),
    )
    .await;
    assert_error(&wrong, 401, "unauthenticated");
    let unknown = raw(
        Method::POST,
        &url,
        None,
        Some(json!({"name": "ghost", "password": "nope-pw"})),
    )
    .await;
    assert_error(&unknown, 401, "unauthenticated");
    assert_eq!(wrong.1["error"]["message"], unknown.1["error"]["message"]);
    assert!(
        !wrong.1.to_string().contains("nope-pw"),
        "no password echoed"
    );
    let ok = raw(
        Method::POST,
        &url,
        None,
        Some(json!({"name": "root", "password": ROOT_PASSWORD})),
    )
    .await;
    assert_eq!(ok.0, 200);
    assert!(ok.1["token"].as_str().is_some_and(|t| t.contains('.')));
    assert!(ok.1["expires_at_ms"].as_u64().is_some());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn authenticate_while_auth_is_off_is_refused() {
    let c = one_node().await;
    c.client().user_add("u", "u-password").await.unwrap();
    let e = c
        .client()
        .authenticate("u", "u-password")
        .await
        .unwrap_err();
    assert_eq!((e.status(), code(&e)), (Some(409), "auth_not_enabled"));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn credentials_are_harmless_while_auth_is_off_and_root_can_enable_with_them() {
    // As etcd's clients: `--user root:...` before `auth enable` works, then keeps working.
    let c = one_node().await;
    let anon = c.client();
    anon.user_add("root", ROOT_PASSWORD).await.unwrap();
    anon.user_grant_role("root", "root").await.unwrap();
    let root = c.client().with_credentials("root", ROOT_PASSWORD);
    root.put("before", "v", None, None).await.unwrap();
    assert!(root.auth_enable().await.unwrap().enabled);
    root.put("after", "v", None, None).await.unwrap();
    assert!(root.token().is_some(), "a token once auth is on");
    let e = anon.put("anon", "v", None, None).await.unwrap_err();
    assert_eq!(code(&e), "unauthenticated");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expired_token_is_401_and_a_client_with_credentials_renews_it() {
    let c = TestCluster::start_tweaked(1, |cfg| cfg.auth_token_ttl_ms = 1500).await;
    c.leader().await;
    let root = enable_auth(&c).await;
    root.put("k", "v", None, None).await.unwrap();
    let token = root.token().expect("authenticated");
    let url = format!("{}/v1/kv/k", c.url(1));
    assert_eq!(raw(Method::GET, &url, Some(&token), None).await.0, 200);
    let expired = eventually(Duration::from_secs(10), "the token to expire", || async {
        let answer = raw(Method::GET, &url, Some(&token), None).await;
        (answer.0 == 401).then_some(answer)
    })
    .await;
    assert_eq!(expired.1["error"]["message"], "the token has expired");
    // The client re-authenticates on the 401 and the call succeeds.
    assert_eq!(root.get("k", false).await.unwrap().unwrap().kv.value, "v");
    assert_ne!(root.token().unwrap(), token);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_role_cannot_write() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    root.put("ro/k", "v", None, None).await.unwrap();
    let reader = user_with(&c, &root, "reader", &[(Read, "ro/", true)]).await;
    assert_eq!(
        reader.get("ro/k", false).await.unwrap().unwrap().kv.value,
        "v"
    );
    for e in [
        reader.put("ro/k", "x", None, None).await.unwrap_err(),
        reader.delete("ro/k", None).await.unwrap_err(),
    ] {
        assert_eq!((e.status(), code(&e)), (Some(403), "permission_denied"));
    }
    assert_eq!(
        root.get("ro/k", false).await.unwrap().unwrap().kv.value,
        "v"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_write_only_role_cannot_read() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let writer = user_with(&c, &root, "writer", &[(Write, "wo", false)]).await;
    writer.put("wo", "v", None, None).await.unwrap();
    let e = writer.get("wo", false).await.unwrap_err();
    assert_eq!(code(&e), "permission_denied");
    let e = writer.put("wo2", "v", None, None).await.unwrap_err();
    assert_eq!(
        code(&e),
        "permission_denied",
        "a key grant is not a prefix grant"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefix_grant_does_not_leak_keys_outside_it_through_get_or_list() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    for k in ["app/1", "app/2", "apple", "other"] {
        root.put(k, "v", None, None).await.unwrap();
    }
    let u = user_with(&c, &root, "app", &[(Readwrite, "app/", true)]).await;
    assert_eq!(u.list("app/", None, false).await.unwrap().items.len(), 2);
    assert_eq!(u.list("app/1", None, false).await.unwrap().items.len(), 1);
    for prefix in ["", "app", "a"] {
        let e = u.list(prefix, None, false).await.unwrap_err();
        assert_eq!(code(&e), "permission_denied", "list {prefix:?}");
    }
    for key in ["apple", "other"] {
        let e = u.get(key, false).await.unwrap_err();
        assert_eq!(code(&e), "permission_denied", "get {key}");
        let e = u.delete(key, None).await.unwrap_err();
        assert_eq!(code(&e), "permission_denied", "delete {key}");
    }
    // A wider grant widens what may be listed.
    root.role_grant("app", Read, "a", true).await.unwrap();
    assert_eq!(u.list("a", None, false).await.unwrap().items.len(), 3);
    assert_eq!(
        code(&u.list("", None, false).await.unwrap_err()),
        "permission_denied"
    );
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_detail_list_and_revoke_need_permission_on_the_lease_keys() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "u", &[(Readwrite, "mine/", true)]).await;
    // Any user may register a lease and attach their own keys.
    u.grant("own", 30_000).await.unwrap();
    u.put("mine/a", "v", Some("own"), None).await.unwrap();
    root.grant("theirs", 30_000).await.unwrap();
    root.put("secret/a", "v", Some("theirs"), None)
        .await
        .unwrap();
    assert_eq!(u.lease("own").await.unwrap().unwrap().keys, vec!["mine/a"]);
    let e = u.lease("theirs").await.unwrap_err();
    assert_eq!(code(&e), "permission_denied");
    let names: Vec<String> = u
        .leases("", None)
        .await
        .unwrap()
        .leases
        .into_iter()
        .map(|l| l.name)
        .collect();
    assert_eq!(
        names,
        vec!["own"],
        "the list leaves out leases with unreadable keys"
    );
    for e in [
        u.revoke("theirs").await.unwrap_err(),
        u.refresh("theirs", None).await.unwrap_err(),
        u.put("mine/b", "v", Some("theirs"), None)
            .await
            .unwrap_err(),
    ] {
        assert_eq!(code(&e), "permission_denied");
    }
    assert!(root.get("secret/a", false).await.unwrap().is_some());
    u.refresh("own", None).await.unwrap();
    assert_eq!(u.revoke("own").await.unwrap().deleted_keys, vec!["mine/a"]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_need_permission_on_their_key() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "agent", &[(Readwrite, "members/", true)]).await;
    let other = user_with(&c, &root, "other", &[(Readwrite, "app/", true)]).await;
    u.register_member("n1", "h:1", 30_000, Default::default())
        .await
        .unwrap();
    assert_eq!(u.members().await.unwrap().members.len(), 1);
    u.heartbeat("n1", None).await.unwrap();
    for e in [
        other
            .register_member("n2", "h:2", 30_000, Default::default())
            .await
            .unwrap_err(),
        other.heartbeat("n1", None).await.unwrap_err(),
        other.leave("n1").await.unwrap_err(),
        other.members().await.unwrap_err(),
    ] {
        assert_eq!(code(&e), "permission_denied");
    }
    u.leave("n1").await.unwrap();
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flease_and_paxoslease_resources_need_permission_on_their_key() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "locker", &[(Readwrite, "flease/jobs/", true)]).await;
    let granted = u.flease_acquire("jobs/a", "me").await.unwrap();
    assert_eq!(granted.granted, Some(true));
    u.flease_get("jobs/a").await.unwrap();
    for e in [
        u.flease_acquire("other", "me").await.unwrap_err(),
        u.flease_get("other").await.unwrap_err(),
        u.flease_release("other", "me").await.unwrap_err(),
        u.resource_acquire(
            leasecore::domain::flease::Protocol::PaxosLease,
            "jobs/a",
            "me",
        )
        .await
        .unwrap_err(),
    ] {
        assert_eq!(code(&e), "permission_denied");
    }
    assert!(u.flease_release("jobs/a", "me").await.unwrap());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_calls_membership_changes_and_snapshots_are_root_only() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "plain", &[(Readwrite, "", true)]).await;
    let token = u.authenticate("plain", "plain-pw").await.unwrap().token;
    let base = c.url(1);
    for (method, path, body) in [
        (Method::GET, "/v1/auth/users", None),
        (Method::GET, "/v1/auth/users/root", None),
        (
            Method::POST,
            "/v1/auth/users",
            Some(json!({"name": "x", "password": "x-password"})),
        ),
        (Method::DELETE, "/v1/auth/users/root", None),
        (Method::PUT, "/v1/auth/users/plain/roles/root", None),
        (Method::POST, "/v1/auth/roles", Some(json!({"name": "r"}))),
        (Method::GET, "/v1/auth/roles", None),
        (Method::POST, "/v1/auth/disable", None),
        (Method::POST, "/v1/auth/enable", None),
        (Method::GET, "/v1/snapshot", None),
        (
            Method::POST,
            "/v1/cluster/nodes",
            Some(json!({"id": 9, "address": "127.0.0.1:9"})),
        ),
        (Method::DELETE, "/v1/cluster/nodes/9", None),
    ] {
        let answer = raw(method, &format!("{base}{path}"), Some(&token), body).await;
        assert_error(&answer, 403, "permission_denied");
    }
    // Readwrite on every key is not root; any user may read the cluster's status.
    assert_eq!(u.cluster_status().await.unwrap().node_id, 1);
    let root_token = root
        .authenticate("root", ROOT_PASSWORD)
        .await
        .unwrap()
        .token;
    let snap = reqwest::Client::new()
        .get(format!("{base}/v1/snapshot"))
        .bearer_auth(&root_token)
        .send()
        .await
        .unwrap();
    assert_eq!(snap.status(), 200);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn users_and_roles_are_managed_and_never_show_a_hash() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    user_with(&c, &root, "u", &[(Read, "a/", true), (Write, "b", false)]).await;
    let e = root.user_add("u", "again-pw").await.unwrap_err();
    assert_eq!((e.status(), code(&e)), (Some(409), "user_exists"));
    let e = root.role_add("u").await.unwrap_err();
    assert_eq!(code(&e), "role_exists");
    let e = root.user_grant_role("u", "nope").await.unwrap_err();
    assert_eq!((e.status(), code(&e)), (Some(404), "role_not_found"));
    let e = root.user_get("nope").await.unwrap_err();
    assert_eq!(code(&e), "user_not_found");
    let e = root.role_revoke("u", "zzz", false).await.unwrap_err();
    assert_eq!(code(&e), "permission_not_granted");
    let e = root.user_add("bad:name", "pw-pw-pw").await.unwrap_err();
    assert_eq!(code(&e), "invalid_argument");
    let (status, doc) = raw(
        Method::GET,
        &format!("{}/v1/auth/users/u", c.url(1)),
        Some(&root.token().unwrap()),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(doc, json!({"name": "u", "roles": ["u"]}));
    let role = root.role_get("u").await.unwrap();
    assert_eq!(role.permissions.len(), 2);
    root.role_revoke("u", "b", false).await.unwrap();
    assert_eq!(root.role_get("u").await.unwrap().permissions.len(), 1);
    assert_eq!(root.user_list().await.unwrap().users, vec!["root", "u"]);
    assert_eq!(root.role_list().await.unwrap().roles, vec!["root", "u"]);
    root.user_revoke_role("u", "u").await.unwrap();
    root.role_delete("u").await.unwrap();
    root.user_delete("u").await.unwrap();
    assert_eq!(root.user_list().await.unwrap().users, vec!["root"]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn root_keeps_the_root_role_while_auth_is_on() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    for e in [
        root.user_delete("root").await.unwrap_err(),
        root.user_revoke_role("root", "root").await.unwrap_err(),
        root.role_delete("root").await.unwrap_err(),
    ] {
        assert_eq!((e.status(), code(&e)), (Some(400), "invalid_argument"));
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_changed_password_or_deleted_user_stops_authenticating() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "u", &[(Readwrite, "", true)]).await;
    let token = u.authenticate("u", "u-pw").await.unwrap().token;
    root.user_passwd("u", "new-password").await.unwrap();
    let e = c.client().authenticate("u", "u-pw").await.unwrap_err();
    assert_eq!(code(&e), "unauthenticated");
    c.client().authenticate("u", "new-password").await.unwrap();
    root.user_delete("u").await.unwrap();
    let answer = raw(
        Method::GET,
        &format!("{}/v1/kv/k", c.url(1)),
        Some(&token),
        None,
    )
    .await;
    assert_error(&answer, 401, "unauthenticated");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disabling_auth_opens_every_route_and_re_enabling_voids_old_tokens() {
    let c = one_node().await;
    let root = enable_auth(&c).await;
    let old = root
        .authenticate("root", ROOT_PASSWORD)
        .await
        .unwrap()
        .token;
    root.auth_disable().await.unwrap();
    let anon = c.client();
    anon.put("open", "v", None, None).await.unwrap();
    assert!(!anon.auth_status().await.unwrap().enabled);
    anon.auth_enable().await.unwrap();
    let answer = raw(
        Method::GET,
        &format!("{}/v1/kv/open", c.url(1)),
        Some(&old),
        None,
    )
    .await;
    assert_error(&answer, 401, "unauthenticated");
    // The root client renews its token by itself.
    assert!(root.get("open", false).await.unwrap().is_some());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_is_valid_on_every_node() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "u", &[(Readwrite, "u/", true)]).await;
    let token = u.authenticate("u", "u-pw").await.unwrap().token;
    for id in 1..=3 {
        let node = c.client_of(id).with_token(token.clone());
        let key = format!("u/{id}");
        node.put(&key, "v", None, None).await.unwrap();
        // A follower may not have applied the user yet right after the grant; it has now.
        let e = node.put("x", "v", None, None).await.unwrap_err();
        assert_eq!(code(&e), "permission_denied", "node {id}");
    }
    assert_eq!(u.list("u/", None, false).await.unwrap().items.len(), 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auth_survives_a_restart_and_a_snapshot() {
    let mut c = TestCluster::start_with(1, 5).await;
    c.leader().await;
    let root = enable_auth(&c).await;
    let u = user_with(&c, &root, "u", &[(Read, "r/", true)]).await;
    for i in 0..10 {
        root.put(&format!("r/{i}"), "v", None, None).await.unwrap();
    }
    let token = u.authenticate("u", "u-pw").await.unwrap().token;
    c.stop(1).await;
    c.restart(1).await;
    c.leader().await;
    let again = c.client().with_token(token);
    assert_eq!(again.list("r/", None, false).await.unwrap().items.len(), 10);
    let e = again.put("r/x", "v", None, None).await.unwrap_err();
    assert_eq!(code(&e), "permission_denied");
    assert!(c.client().auth_status().await.unwrap().enabled);
    c.shutdown().await;
}

/// Run the binary with `args` against `ep`, `stdin` as its input: (success, stdout + stderr).
fn run_cli(bin: &str, ep: &str, args: &[&str], stdin: &str) -> (bool, String) {
    use std::io::Write as _;
    let mut child = std::process::Command::new(bin)
        .args(args)
        .args(["--endpoints", ep])
        .env_remove("LEASECORE_USER")
        .env_remove("LEASECORE_TOKEN")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.as_bytes()).unwrap();
    drop(input);
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cli_manages_users_and_authenticates_with_user_flag() {
    let c = one_node().await;
    let bin = env!("CARGO_BIN_EXE_leasecore");
    let ep = c.url(1);
    let root_user = format!("root:{ROOT_PASSWORD}");
    let steps: Vec<(Vec<&str>, &str, bool)> = vec![
        (vec!["user", "add", "root"], "root-secret-pw\n", true),
        (vec!["user", "grant-role", "root", "root"], "", true),
        (vec!["auth", "enable"], "", true),
        (vec!["kv", "put", "k", "v"], "", false),
        (vec!["kv", "put", "k", "v", "--user", &root_user], "", true),
        (
            vec!["role", "add", "reader", "--user", &root_user],
            "",
            true,
        ),
        (
            vec!["role", "grant", "reader", "read", "k", "--user", &root_user],
            "",
            true,
        ),
        (
            vec!["user", "add", "bob", "--user", &root_user],
            "bob-password\n",
            true,
        ),
        (
            vec!["user", "grant-role", "bob", "reader", "--user", &root_user],
            "",
            true,
        ),
        (
            vec!["kv", "get", "k", "--user", "bob:bob-password"],
            "",
            true,
        ),
        (
            vec!["kv", "put", "k", "x", "--user", "bob:bob-password"],
            "",
            false,
        ),
        (vec!["kv", "get", "k", "--user", "bob"], "", false),
        (
            vec!["role", "get", "reader", "--user", &root_user],
            "",
            true,
        ),
        (vec!["auth", "status"], "", true),
    ];
    for (args, stdin, ok) in steps {
        let (success, output) = run_cli(bin, &ep, &args, stdin);
        assert_eq!(success, ok, "{args:?}: {output}");
        assert!(!output.contains("bob-password"), "{output}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_without_credentials_keeps_its_401() {
    let c = one_node().await;
    enable_auth(&c).await;
    let e = c.client().get("k", false).await.unwrap_err();
    assert_eq!((e.status(), code(&e)), (Some(401), "unauthenticated"));
    let e = Client::new(&[c.url(1)])
        .unwrap()
        .with_token("x.y")
        .get("k", false)
        .await
        .unwrap_err();
    assert_eq!(code(&e), "unauthenticated");
    c.shutdown().await;
}
