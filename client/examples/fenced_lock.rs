//! A lock with a fencing token, checked by the resource it protects.
//!
//! Each worker takes the lock `counter`, reads the counter, and writes it back plus one,
//! sending its fencing token with the write. The "storage" (a toy, in this process) refuses a
//! write whose token is lower than the highest it has seen: a worker that was paused while
//! holding the lock, and whose lease expired meanwhile, cannot clobber a newer holder's work.
//!
//! ```sh
//! scripts/cluster.sh start    # or LEASECORE_ENDPOINTS=http://host:7001,... for a cluster elsewhere
//! cargo run -p leasecore-client --example fenced_lock
//! ```

use std::sync::{Arc, Mutex};

use leasecore_client::types::Revision;
use leasecore_client::{Client, Session};

/// The protected resource: a counter that checks fencing tokens.
#[derive(Default)]
struct FencedCounter {
    highest_token: Revision,
    value: u64,
}

impl FencedCounter {
    fn write(&mut self, token: Revision, value: u64) -> Result<(), String> {
        if token < self.highest_token {
            return Err(format!(
                "refused: token {token} is older than {}",
                self.highest_token
            ));
        }
        self.highest_token = token;
        self.value = value;
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let client = Arc::new(Client::from_env()?);
    let storage = Arc::new(Mutex::new(FencedCounter::default()));
    let mut workers = Vec::new();
    for w in 0..4 {
        let client = client.clone();
        let storage = storage.clone();
        workers.push(tokio::spawn(async move {
            let session = Session::new(client, 5_000).await?;
            for _ in 0..5 {
                let held = session.lock("counter").await?;
                let read = storage.lock().unwrap().value;
                let result = storage.lock().unwrap().write(held.revision, read + 1);
                println!("worker {w}, token {}: {result:?}", held.revision);
                session.unlock("counter").await?;
            }
            session.close().await
        }));
    }
    for w in workers {
        w.await??;
    }
    println!("counter = {}", storage.lock().unwrap().value);
    Ok(())
}
