//! `leasecore cluster status|add|remove`: the Raft membership (status and add print through
//! `cluster_health`).

use clap::Subcommand;
use leasecore::client::ClientError;
use leasecore::domain::types::NodeId;

use super::{ConnArgs, cluster_health, print_json};

#[derive(Subcommand)]
pub enum ClusterCmd {
    /// Show the leader, terms, indexes and members (reachability, last contact, lag). Exits
    /// non-zero when the node knows no leader.
    Status {
        /// Only ask each endpoint's /readyz; exit non-zero unless all are ready (healthchecks).
        #[arg(long)]
        ready: bool,
    },
    /// Add a node (it must be running with --join): learner first, then voter.
    Add {
        /// The new node's id (its `serve --id`).
        id: NodeId,
        /// The new node's advertised address, HOST:PORT (its client port; peers use port + 1000).
        address: String,
    },
    /// Remove a node from the membership.
    Remove {
        /// The id of the node to remove.
        id: NodeId,
    },
    /// Hand the leadership to a voter (before restarting the leader, say); returns once it
    /// leads. Takes about one election timeout.
    MoveLeader {
        /// The id of the voter that is to lead.
        id: NodeId,
    },
}

pub async fn run(cmd: ClusterCmd, conn: &ConnArgs) -> Result<(), ClientError> {
    let client = conn.client()?;
    let view = match cmd {
        ClusterCmd::Status { ready } => {
            let token = conn.bearer().await?;
            return cluster_health::status(&conn.endpoints, conn.json, ready, token).await;
        }
        ClusterCmd::Add { id, address } => {
            return cluster_health::add(&client, conn.json, id, &address).await;
        }
        ClusterCmd::Remove { id } => client.remove_node(id).await?,
        ClusterCmd::MoveLeader { id } => client.move_leader(id).await?,
    };
    if conn.json {
        print_json(&view);
        return Ok(());
    }
    let leader = view
        .leader_id
        .map(|l| l.to_string())
        .unwrap_or_else(|| "none".into());
    println!(
        "node {} ({}), leader {leader}, term {}, commit {}, applied {}, revision {}",
        view.node_id, view.state, view.term, view.commit_index, view.applied_index, view.revision
    );
    println!("{:>6}  {:<24}  role", "id", "address");
    for n in &view.nodes {
        let role = match (n.voter, Some(n.id) == view.leader_id) {
            (true, true) => "voter (leader)",
            (true, false) => "voter",
            (false, _) => "learner",
        };
        println!("{:>6}  {:<24}  {role}", n.id, n.address);
    }
    Ok(())
}
