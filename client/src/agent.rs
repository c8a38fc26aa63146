//! The member agent: register, heartbeat every `ttl / 3`, re-register if the registration was
//! lost, deregister on shutdown. What `leasecore agent` runs beside a service.
//!
//! A registration that already exists at start (this agent restarted before its lease ran
//! out) is adopted by heartbeating it; if it is gone by then, the agent registers anew. A
//! heartbeat answered `member_not_found` means the lease expired (the agent was cut off for
//! longer than its TTL): the agent registers again, and watchers see a leave then a join.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{Client, ClientError};

/// What the agent reports as it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentEvent {
    Registered { revision: u64 },
    Adopted,
    Heartbeat { remaining_ms: u64 },
    HeartbeatFailed { error: String },
    Reregistering,
    Left,
}

/// One member's registration.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub id: String,
    pub address: String,
    pub ttl_ms: u64,
    pub meta: BTreeMap<String, String>,
}

async fn register(client: &Client, cfg: &AgentConfig) -> Result<AgentEvent, ClientError> {
    match client
        .register_member(&cfg.id, &cfg.address, cfg.ttl_ms, cfg.meta.clone())
        .await
    {
        Ok(r) => Ok(AgentEvent::Registered {
            revision: r.revision.0,
        }),
        Err(e) if e.code() == Some("member_exists") => {
            match client.heartbeat(&cfg.id, None).await {
                Ok(_) => Ok(AgentEvent::Adopted),
                // It expired between the two calls: try again from the start.
                Err(h) if h.code() == Some("member_not_found") => client
                    .register_member(&cfg.id, &cfg.address, cfg.ttl_ms, cfg.meta.clone())
                    .await
                    .map(|r| AgentEvent::Registered {
                        revision: r.revision.0,
                    }),
                Err(h) => Err(h),
            }
        }
        Err(e) => Err(e),
    }
}

/// Run until `shutdown` completes, then deregister. `report` sees every event.
pub async fn run_agent(
    client: Arc<Client>,
    cfg: AgentConfig,
    shutdown: impl Future<Output = ()>,
    mut report: impl FnMut(&AgentEvent),
) -> Result<(), ClientError> {
    let period = Duration::from_millis((cfg.ttl_ms / 3).max(1));
    let retry = Duration::from_millis((cfg.ttl_ms / 10).clamp(50, 1000));
    report(&register(&client, &cfg).await?);
    tokio::pin!(shutdown);
    let mut wait = period;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(wait) => {}
        }
        match client.heartbeat(&cfg.id, Some(period)).await {
            Ok(h) => {
                report(&AgentEvent::Heartbeat {
                    remaining_ms: h.remaining_ms,
                });
                wait = period;
            }
            Err(e) if e.code() == Some("member_not_found") => {
                report(&AgentEvent::Reregistering);
                match register(&client, &cfg).await {
                    Ok(ev) => {
                        report(&ev);
                        wait = period;
                    }
                    Err(e) => {
                        report(&AgentEvent::HeartbeatFailed {
                            error: e.to_string(),
                        });
                        wait = retry;
                    }
                }
            }
            Err(e) => {
                report(&AgentEvent::HeartbeatFailed {
                    error: e.to_string(),
                });
                wait = retry;
            }
        }
    }
    match client.leave(&cfg.id).await {
        Ok(_) => {}
        Err(e) if e.code() == Some("member_not_found") => {}
        Err(e) => return Err(e),
    }
    report(&AgentEvent::Left);
    Ok(())
}
