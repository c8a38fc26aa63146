//! Leader election: campaign for `primary`, do leader work while leading, step down on Ctrl-C.
//!
//! ```sh
//! scripts/cluster.sh start    # or LEASECORE_ENDPOINTS=http://host:7001,... for a cluster elsewhere
//! cargo run -p leasecore-client --example leader_election -- 10.0.0.5:5432
//! ```
//! Run it twice: the second waits, and takes over within its TTL when the first is killed.

use std::sync::Arc;

use leasecore_client::{Client, Session};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let me = std::env::args()
        .nth(1)
        .unwrap_or_else(|| format!("pid-{}", std::process::id()));
    let client = Arc::new(Client::from_env()?);
    // One lease, kept alive in the background: if this process dies, leadership passes on
    // within 5 s.
    let session = Session::new(client.clone(), 5_000).await?;
    println!("campaigning as {me}");
    let elected = session.campaign("primary", &me).await?;
    println!("leading (term {}); Ctrl-C to resign", elected.revision);
    tokio::select! {
        // Leadership is only as good as the lease: stop leader work the moment it is lost.
        reason = session.lost() => println!("lost leadership: {reason}"),
        _ = tokio::signal::ctrl_c() => {
            session.resign("primary").await?;
            println!("resigned");
        }
    }
    session.close().await?;
    Ok(())
}
