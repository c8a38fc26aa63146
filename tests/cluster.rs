//! End-to-end: a 3-node cluster over real HTTP on loopback.

mod common;

use std::time::Duration;

use common::{TestCluster, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_through_any_node_are_readable_linearizably_from_every_node() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    for (i, id) in [1u64, 2, 3].into_iter().enumerate() {
        let key = format!("k/{i}");
        let put = c.client_of(id).put(&key, &format!("v{i}"), None, None).await.unwrap();
        for reader in [1u64, 2, 3] {
            let got = c.client_of(reader).get(&key, false).await.unwrap().unwrap();
            assert_eq!(got.kv.value, format!("v{i}"));
            assert_eq!(got.kv.mod_revision, put.revision);
        }
    }
    let list = c.client().list("k/", None, false).await.unwrap();
    assert_eq!(list.items.len(), 3);
    c.shutdown().await;
}
