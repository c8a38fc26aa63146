//! `leasecore cluster status` and `cluster add`: what the operator (and the compose
//! healthcheck) sees of the cluster's health.
//!
//! - `cluster status` prints a node's view: leader, indexes, and per member its role,
//!   reachability, last contact and replication lag (as etcd's `endpoint status`). Given
//!   several endpoints it prefers the leader's view (the only one that knows every member). It
//!   exits non-zero when that node knows no leader.
//! - `cluster status --ready` asks every endpoint's `/readyz` (no failover: each endpoint is
//!   judged on its own) and exits non-zero unless all are ready. The container image has no
//!   shell and no curl, so this is what the compose healthcheck runs.
//! - `cluster add` says when the node stayed a learner (it did not answer or catch up in time).
//!
//! It decides nothing: readiness is the server's verdict (`domain::health`).

use std::time::Duration;

use leasecore::client::{Client, ClientError};
use leasecore::raft::consensus::ClusterView;

/// `cluster status [--ready]`.
pub async fn status(
    endpoints: &[String],
    json: bool,
    ready: bool,
    token: Option<String>,
) -> Result<(), ClientError> {
    if ready {
        return readiness(endpoints, json).await;
    }
    let view = best_view(endpoints, token).await?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&view).expect("plain data serializes")
        );
    } else {
        print_view(&view);
    }
    match view.leader_id {
        Some(_) => Ok(()),
        None => Err(ClientError::Usage(no_leader_verdict(&view))),
    }
}

/// Why the status exits non-zero: no leader, and when this node last heard from the other
/// voters (minutes of silence from most of them is a lost quorum, not an election).
fn no_leader_verdict(view: &ClusterView) -> String {
    let contacts: Vec<String> = view
        .nodes
        .iter()
        .filter(|n| n.voter && n.id != view.node_id)
        .map(|n| match n.status.last_contact_ms {
            Some(ms) => format!("node {} {ms} ms ago", n.id),
            None => format!("node {} never", n.id),
        })
        .collect();
    let needed = view.nodes.iter().filter(|n| n.voter).count() / 2 + 1;
    format!(
        "no leader: node {} knows none (a leader needs {needed} voters); it last heard from {}",
        view.node_id,
        if contacts.is_empty() {
            "no other voter".to_string()
        } else {
            contacts.join(", ")
        }
    )
}

/// The leader's view if one of the endpoints is the leader (only the leader knows every
/// member's reachability and lag), else the first view any endpoint gives.
async fn best_view(
    endpoints: &[String],
    token: Option<String>,
) -> Result<ClusterView, ClientError> {
    let authed = |c: Client| match &token {
        Some(t) => c.with_token(t.clone()),
        None => c,
    };
    if endpoints.len() > 1 {
        let mut first = None;
        for ep in endpoints {
            let Ok(client) = Client::with_timeout(std::slice::from_ref(ep), Duration::from_secs(2))
            else {
                continue;
            };
            let client = authed(client);
            match client.cluster_status().await {
                Ok(v) if v.leader_id == Some(v.node_id) && v.state == "leader" => return Ok(v),
                Ok(v) => {
                    first.get_or_insert(v);
                }
                Err(_) => {}
            }
        }
        if let Some(v) = first {
            return Ok(v);
        }
    }
    authed(Client::new(endpoints)?).cluster_status().await
}

/// `cluster add ID ADDRESS`.
pub async fn add(client: &Client, json: bool, id: u64, address: &str) -> Result<(), ClientError> {
    let answer = client.add_node_detailed(id, address).await?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&answer).expect("plain data serializes")
        );
    } else {
        print_view(&answer.view);
    }
    if let Some(message) = &answer.message {
        eprintln!("{message}");
    }
    Ok(())
}

/// Every endpoint's `/readyz`; an error unless all are ready.
async fn readiness(endpoints: &[String], json: bool) -> Result<(), ClientError> {
    let mut not_ready = Vec::new();
    for ep in endpoints {
        // One endpoint per client: a node's readiness is its own, not its neighbour's.
        let client = Client::with_timeout(std::slice::from_ref(ep), Duration::from_secs(2))?;
        match client.readyz().await {
            Ok(doc) if json => println!("{doc}"),
            Ok(_) => println!("{ep}: ready"),
            Err(e) => {
                if json {
                    if let ClientError::Api { body, .. } = &e {
                        println!("{body}");
                    }
                } else {
                    println!("{ep}: not ready: {e}");
                }
                not_ready.push(ep.clone());
            }
        }
    }
    if not_ready.is_empty() {
        Ok(())
    } else {
        Err(ClientError::Unavailable(format!(
            "not ready: {}",
            not_ready.join(", ")
        )))
    }
}

fn print_view(view: &ClusterView) {
    let leader = view
        .leader_id
        .map(|l| l.to_string())
        .unwrap_or_else(|| "none".into());
    let ready = match &view.not_ready {
        None if view.ready => "ready".to_string(),
        None => "not ready".to_string(),
        Some(why) => format!(
            "not ready ({})",
            serde_json::to_string(why).unwrap_or_default()
        ),
    };
    println!(
        "node {} ({}, {ready}), leader {leader}, term {}, commit {}, applied {}, revision {}",
        view.node_id, view.state, view.term, view.commit_index, view.applied_index, view.revision
    );
    println!(
        "{:>6}  {:<24}  {:<15}  {:<10}  {:>12}  {:>8}",
        "id", "address", "role", "reachable", "last contact", "lag"
    );
    let or_dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for n in &view.nodes {
        let role = match (n.voter, Some(n.id) == view.leader_id) {
            (true, true) => "voter (leader)",
            (true, false) => "voter",
            (false, _) => "learner",
        };
        let reachable = or_dash(
            n.status
                .reachable
                .map(|r| (if r { "yes" } else { "NO" }).into()),
        );
        let contact = or_dash(n.status.last_contact_ms.map(|ms| format!("{ms} ms ago")));
        let lag = or_dash(n.status.lag.map(|l| l.to_string()));
        println!(
            "{:>6}  {:<24}  {role:<15}  {reachable:<10}  {contact:>12}  {lag:>8}",
            n.id, n.address
        );
    }
}
