//! Membership discovery: register this process as a member (heartbeating in the background)
//! and follow the others joining and leaving, from a listing and then a watch that resumes
//! by revision (no join or leave is missed, even across reconnects).
//!
//! ```sh
//! scripts/cluster.sh start    # or LEASECORE_ENDPOINTS=http://host:7001,... for a cluster elsewhere
//! cargo run -p leasecore-client --example membership -- web-1 10.0.0.5:8080
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use leasecore_client::agent::{AgentConfig, run_agent};
use leasecore_client::api::{EventKind, MemberRecord};
use leasecore_client::{Client, WatchFilter, WatchItem, Watcher};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let id = args.next().unwrap_or_else(|| "example".into());
    let address = args.next().unwrap_or_else(|| "127.0.0.1:8080".into());
    let client = Arc::new(Client::from_env()?);

    // Register and heartbeat until Ctrl-C, then deregister.
    let cfg = AgentConfig {
        id,
        address,
        ttl_ms: 5_000,
        meta: BTreeMap::new(),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(run_agent(
        client.clone(),
        cfg,
        async {
            let _ = stopped.await;
        },
        |event| println!("agent: {event:?}"),
    ));

    // Who is there now, and from which revision to follow.
    let list = client.members().await?;
    for m in &list.members {
        println!("member {} at {}", m.id, m.address);
    }
    let mut watcher = Watcher::new(
        client.clone(),
        WatchFilter::Prefix("members/".into()),
        Some(list.revision.0 + 1),
    );
    loop {
        tokio::select! {
            item = watcher.next() => match item? {
                WatchItem::Event(e) if e.kind == EventKind::Put => {
                    let m = e.value.as_deref().and_then(MemberRecord::decode);
                    println!("joined: {}", m.map_or(e.key, |m| format!("{} at {}", m.id, m.address)));
                }
                WatchItem::Event(e) => println!("left: {} ({:?})", e.key, e.cause),
                WatchItem::Resync { items, .. } => println!("resynced: {} members", items.len()),
            },
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    // Deregister: the others see this member leave at once (not after its TTL).
    let _ = stop.send(());
    agent.await??;
    Ok(())
}
