//! `leasecore serve --config`, `--dry-run`, `--version` and `GET /version` (issue 12, item 8),
//! run as an operator runs them: precedence flags > environment > file > defaults, unknown
//! keys and bad values refused with the file and key named, the shipped example file complete
//! and in step with the built-in defaults, and a node started from a file.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{eventually, free_node_addrs};

const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/leasecore.example.toml");

fn leasecore() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasecore"));
    // The settings under test come from the test, not from the caller's environment.
    for (k, _) in std::env::vars() {
        if k.starts_with("LEASECORE_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `serve --dry-run` with `args`: setting → (value as printed, source).
fn dry_run(cmd: &mut Command) -> BTreeMap<String, (String, String)> {
    let out = cmd.arg("--dry-run").output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let (key, rest) = l.split_once(" = ").unwrap();
            let (value, source) = rest.rsplit_once("  # ").unwrap();
            (key.to_string(), (value.to_string(), source.to_string()))
        })
        .collect()
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn flags_beat_the_environment_which_beats_the_file_which_beats_the_defaults() {
    let tmp = tempfile::tempdir().unwrap();
    let file = write(
        tmp.path(),
        "node.toml",
        "id = 7\nheartbeat-ms = 77\nelection_min_ms = 700\nelection_max_ms = 1400\n\
         join = true\npeers = { 7 = \"127.0.0.1:7001\", 8 = \"127.0.0.1:7002\" }\n",
    );
    let settings = dry_run(
        leasecore()
            .args(["serve", "--config"])
            .arg(&file)
            .env("LEASECORE_ELECTION_MIN_MS", "500")
            .env("LEASECORE_ELECTION_MAX_MS", "1500")
            .args(["--election-max-ms", "1600"]),
    );
    let shown = file.display().to_string();
    let is = |k: &str, v: &str, src: &str| {
        assert_eq!(
            settings[k],
            (v.to_string(), src.to_string()),
            "{k}: {settings:#?}"
        )
    };
    is("id", "7", &shown);
    is("heartbeat_ms", "77", &shown);
    is("join", "true", &shown);
    is("peers", "\"7=127.0.0.1:7001,8=127.0.0.1:7002\"", &shown);
    is("election_min_ms", "500", "environment");
    is("election_max_ms", "1600", "flag");
    is("snapshot_threshold", "10000", "default");
}

#[test]
fn a_typo_or_a_bad_value_in_the_file_is_refused_with_the_file_and_key_named() {
    let tmp = tempfile::tempdir().unwrap();
    for (text, expected) in [
        ("heartbeet_ms = 100\n", "unknown key \"heartbeet_ms\""),
        (
            "heartbeat_ms = \"often\"\n",
            "heartbeat_ms: invalid value 'often'",
        ),
        ("log_format = \"xml\"\n", "log_format: invalid value 'xml'"),
        ("join = \"maybe\"\n", "join: \"maybe\" is not a boolean"),
        ("id = [\n", "is not valid TOML"),
    ] {
        let file = write(tmp.path(), "bad.toml", text);
        let out = leasecore()
            .args(["serve", "--config"])
            .arg(&file)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{text}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(err.contains(&file.display().to_string()), "{text}: {err}");
        assert!(err.contains(expected), "{text}: {err}");
    }
    let missing = leasecore()
        .args(["serve", "--config", "/nonexistent/leasecore.toml"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(stderr(&missing).contains("/nonexistent/leasecore.toml"));
}

/// docs/leasecore.example.toml names every setting, and each commented default is the
/// built-in one: the example cannot drift from the binary.
#[test]
fn the_example_file_is_valid_complete_and_shows_the_real_defaults() {
    let defaults = dry_run(leasecore().arg("serve"));
    let example = std::fs::read_to_string(EXAMPLE).unwrap();
    let in_force = dry_run(leasecore().args(["serve", "--config", EXAMPLE]));
    for (key, (default, _)) in &defaults {
        let set = example
            .lines()
            .find(|l| l.starts_with(&format!("{key} = ")));
        let commented = example
            .lines()
            .find(|l| l.starts_with(&format!("# {key} = ")));
        match (set, commented) {
            (Some(_), _) => assert_eq!(in_force[key].1, EXAMPLE, "{key} comes from the file"),
            (None, Some(line)) => {
                let shown = line.trim_start_matches(&format!("# {key} = "));
                assert_eq!(shown, default, "the example's default of {key}");
            }
            (None, None) => panic!("docs/leasecore.example.toml does not mention {key}"),
        }
    }
    // Settings without a default (advertise, TLS files...) are mentioned too.
    let out = leasecore().args(["serve", "--dry-run"]).output().unwrap();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        if let Some(key) = line
            .strip_prefix("# ")
            .and_then(|l| l.strip_suffix(" =  (not set)"))
        {
            assert!(
                example
                    .lines()
                    .any(|l| l.starts_with(&format!("# {key} = "))
                        || l.starts_with(&format!("{key} = "))),
                "docs/leasecore.example.toml does not mention {key}"
            );
        }
    }
}

#[test]
fn version_names_the_commit_and_the_formats() {
    let out = leasecore().arg("--version").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with(&format!("leasecore {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    let storage = format!("storage format: {}", leasecore::storage::STORAGE_FORMAT);
    for part in ["API: v1", &storage, "backup format: 1"] {
        assert!(text.contains(part), "{text}");
    }
}

/// A node runs from a configuration file, and `GET /version` answers what `--version` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_from_a_file_serves_its_version() {
    let tmp = tempfile::tempdir().unwrap();
    let addr = free_node_addrs(1).remove(0);
    let data = tmp.path().join("data");
    let file = write(
        tmp.path(),
        "node.toml",
        &format!(
            "id = 1\nlisten = \"{addr}\"\ndata = {:?}\nlog_format = \"json\"\n",
            data.display().to_string()
        ),
    );
    let mut node = leasecore()
        .args(["serve", "--config"])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let http = reqwest::Client::new();
    let version: serde_json::Value =
        eventually(Duration::from_secs(30), "GET /version", || async {
            let r = http
                .get(format!("http://{addr}/version"))
                .send()
                .await
                .ok()?;
            r.json().await.ok()
        })
        .await;
    node.kill().unwrap();
    node.wait().unwrap();
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(version["api_version"], "v1");
    assert_eq!(
        version["storage_format"],
        leasecore::storage::STORAGE_FORMAT
    );
    let commit = version["git_commit"].as_str().unwrap();
    let cli = leasecore().arg("--version").output().unwrap();
    assert!(
        String::from_utf8_lossy(&cli.stdout).contains(&format!("(commit {commit})")),
        "the binary and the node agree on the commit"
    );
    // The node used the file's data directory.
    assert!(data.join("conf").exists() || data.read_dir().unwrap().next().is_some());
}
