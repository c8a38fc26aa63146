//! The README's walkthrough, run for real, so that it cannot drift from what leasecore does.
//!
//! Every command in the shell blocks of README.md, from "## A walkthrough with curl" up to the
//! authentication section, runs in order against a fresh 3-node cluster: `curl` lines are
//! sent as the HTTP requests they describe (`localhost:700N` is node N), `leasecore` lines run
//! the built binary. Where the README prints an answer (a `# ...` line right under the
//! command), the real answer must match it: the same JSON fields with the same values, except
//! times that depend on the moment (`remaining_ms`, `valid_ms`, `epoch`), which need only be
//! numbers; a trailing `(409)` is the expected status. Commands that never end (`curl -N`
//! streams, `--hold`) are skipped; a 503 (nothing done, the cluster cannot answer yet) is
//! retried for a while, as a user would.

use crate::common;

use std::time::Duration;

use common::TestCluster;
use serde_json::Value;

/// Fields whose value depends on when the command ran.
const TIMING_FIELDS: [&str; 3] = ["remaining_ms", "valid_ms", "epoch"];

/// One runnable line of the walkthrough and the answer the README prints for it, if any.
#[derive(Debug)]
struct Step {
    line: usize,
    command: String,
    expected: Option<String>,
}

fn walkthrough() -> Vec<Step> {
    let readme = include_str!("../README.md");
    let start = readme
        .find("## A walkthrough with curl")
        .expect("README has a walkthrough");
    let end = readme[start..]
        .find("### Authentication")
        .map_or(readme.len(), |i| start + i);
    let first_line = readme[..start].lines().count() + 1;
    let lines: Vec<&str> = readme[start..end].lines().collect();
    let mut steps = Vec::new();
    let mut in_shell = false;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_end();
        if line.starts_with("```") {
            in_shell = !in_shell && line.starts_with("```sh");
        } else if in_shell && (line.starts_with("curl ") || line.starts_with("leasecore ")) {
            // An answer is JSON under any command; under a `leasecore` command, any `# ` line
            // (the CLI block has no comment lines under its commands).
            let is_cli = line.starts_with("leasecore ");
            let expected = lines
                .get(i + 1)
                .and_then(|next| next.strip_prefix("# "))
                .filter(|e| is_cli || e.starts_with('{') || e.starts_with('['))
                .map(str::to_string);
            steps.push(Step {
                line: first_line + i,
                command: line.to_string(),
                expected,
            });
        }
        i += 1;
    }
    steps
}

/// Split a shell line into words: single and double quotes group, a `#` after blanks starts a
/// comment, `|` ends the command (what follows it is the user's own filter).
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut has = false;
    let mut quote: Option<char> = None;
    let mut prev_blank = true;
    for c in line.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => cur.push(c),
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                has = true;
            }
            None if c == '#' && prev_blank => break,
            None if c == '|' => break,
            None if c.is_whitespace() => {
                if has {
                    out.push(std::mem::take(&mut cur));
                    has = false;
                }
            }
            None => {
                cur.push(c);
                has = true;
            }
        }
        prev_blank = quote.is_none() && c.is_whitespace();
    }
    if has {
        out.push(cur);
    }
    out
}

/// `localhost:700N/...` as node N's URL on the test cluster.
fn node_url(c: &TestCluster, url: &str) -> String {
    let url = url
        .trim_start_matches("http://")
        .trim_start_matches("127.0.0.1:")
        .trim_start_matches("localhost:");
    let (port, rest) = url.split_at(url.find('/').unwrap_or(url.len()));
    let id: u64 = port.parse::<u64>().expect("a 700N port") - 7000;
    format!("{}{rest}", c.url(id))
}

/// The README's answer: JSON and an optional `(status)`, or plain text.
fn parse_expected(e: &str) -> (Option<Value>, Option<u16>, String) {
    let (body, status) = match e.trim_end().rsplit_once("  (") {
        Some((b, s)) if s.ends_with(')') => (b, s.trim_end_matches(')').parse().ok()),
        _ => (e.trim_end(), None),
    };
    (serde_json::from_str(body).ok(), status, body.to_string())
}

/// Whether `actual` has the README's fields and values (times only need to be numbers).
fn matches(expected: &Value, actual: &Value, field: &str) -> bool {
    if TIMING_FIELDS.contains(&field) {
        return expected.is_number() && actual.is_number();
    }
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            e.len() == a.len()
                && e.iter()
                    .all(|(k, v)| a.get(k).is_some_and(|av| matches(v, av, k)))
        }
        (Value::Array(e), Value::Array(a)) => {
            e.len() == a.len() && e.iter().zip(a).all(|(e, a)| matches(e, a, field))
        }
        (e, a) => e == a,
    }
}

async fn run_curl(c: &TestCluster, http: &reqwest::Client, args: &[String]) -> (u16, String) {
    let mut method = reqwest::Method::GET;
    let mut body = None;
    let mut url = None;
    let mut headers = Vec::new();
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "-s" => {}
            "-d" => body = it.next().cloned(),
            "-H" => headers.push(it.next().cloned().unwrap()),
            m if m.starts_with("-X") => method = m[2..].parse().unwrap(),
            u if u.contains(":70") => url = Some(node_url(c, u)),
            other => panic!("the walkthrough test does not know curl's {other}"),
        }
    }
    if body.is_some() && method == reqwest::Method::GET {
        method = reqwest::Method::POST;
    }
    let mut req = http
        .request(method, url.expect("a URL"))
        .timeout(Duration::from_secs(40));
    for h in headers {
        let (k, v) = h.split_once(':').unwrap();
        req = req.header(k.trim(), v.trim());
    }
    if let Some(b) = body {
        req = req.body(b);
    }
    let resp = req.send().await.expect("the request is answered");
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

fn run_leasecore(c: &TestCluster, args: &[String]) -> (u16, String) {
    let mut args: Vec<String> = args[1..].to_vec();
    match args.iter().position(|a| a == "--endpoints") {
        Some(i) => {
            args[i + 1] = args[i + 1]
                .split(',')
                .map(|u| node_url(c, u))
                .collect::<Vec<_>>()
                .join(",");
        }
        // Before the subcommand (connection flags are global): after a `--`, it would be the
        // wrapped command's argument.
        None => args
            .splice(0..0, ["--endpoints".to_string(), c.url(1)])
            .for_each(drop),
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasecore"))
        .args(&args)
        .output()
        .expect("run leasecore");
    let code = if out.status.success() { 0 } else { 1 };
    (code, String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_walkthrough_prints_what_leasecore_answers() {
    let steps = walkthrough();
    assert!(
        steps.iter().filter(|s| s.expected.is_some()).count() >= 15,
        "the walkthrough lost its printed answers: {steps:#?}"
    );
    let c = TestCluster::start(3).await;
    c.leader().await;
    let http = reqwest::Client::new();
    let mut checked = 0;
    for step in &steps {
        let args = words(&step.command);
        if args
            .iter()
            .any(|a| (a.starts_with("-s") && a.contains('N')) || a == "--hold")
            || args[..2] == ["leasecore", "elect"]
        {
            continue; // a stream, or a hold until Ctrl-C: it never ends
        }
        // A 503 means nothing was done and the cluster cannot answer yet (Flease's restart
        // wait after the cluster starts): try again, as a user would.
        let mut attempts = 150; // 30 s at 200 ms apart
        let (status, out) = loop {
            let (status, out) = if args[0] == "curl" {
                run_curl(&c, &http, &args).await
            } else {
                run_leasecore(&c, &args)
            };
            attempts -= 1;
            if status != 503 || attempts == 0 {
                break (status, out);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let Some(expected) = &step.expected else {
            assert!(
                status < 400,
                "README line {}: `{}` failed ({status}): {out}",
                step.line,
                step.command
            );
            continue;
        };
        let (json, want_status, text) = parse_expected(expected);
        match json {
            Some(want) => {
                let got: Value = serde_json::from_str(out.trim())
                    .unwrap_or_else(|e| panic!("README line {}: not JSON ({e}): {out}", step.line));
                assert!(
                    matches(&want, &got, ""),
                    "README line {}: `{}`\n  README says: {want}\n  leasecore:   {got}",
                    step.line,
                    step.command
                );
                if let Some(s) = want_status {
                    assert_eq!(status, s, "README line {}: status", step.line);
                } else {
                    assert!(status < 400, "README line {}: status {status}", step.line);
                }
            }
            None => assert_eq!(
                out.trim(),
                text,
                "README line {}: `{}`",
                step.line,
                step.command
            ),
        }
        checked += 1;
    }
    assert!(checked >= 15, "only {checked} answers checked");
    c.shutdown().await;
}

#[test]
fn the_shell_words_are_split_as_a_shell_would() {
    assert_eq!(
        words(r#"curl -s -XPUT 'localhost:7001/v1/kv/a?x=1' -d '{"value": "b c"}'  # note"#),
        [
            "curl",
            "-s",
            "-XPUT",
            "localhost:7001/v1/kv/a?x=1",
            "-d",
            r#"{"value": "b c"}"#
        ]
    );
    assert_eq!(
        words("curl -s localhost:7001/metrics | grep leasecore_raft"),
        ["curl", "-s", "localhost:7001/metrics"]
    );
}

/// JSON answers end with a newline (so that `curl` output does not run into the prompt), and a
/// whole body keeps an exact Content-Length.
#[tokio::test]
async fn json_answers_end_with_a_newline() {
    let c = TestCluster::start(1).await;
    c.leader().await;
    let http = reqwest::Client::new();
    // An answer past 16 KiB gets its newline as a second chunk rather than by a copy.
    c.client()
        .put("big", &"x".repeat(40_000), None, None)
        .await
        .unwrap();
    for path in [
        "/v1/cluster",
        "/v1/kv/missing",
        "/no/such/route",
        "/v1/kv/big",
    ] {
        let resp = http
            .get(format!("{}{path}", c.url(1)))
            .send()
            .await
            .unwrap();
        let length = resp.content_length();
        let body = resp.bytes().await.unwrap();
        assert!(body.ends_with(b"}\n"), "{path}: {body:?}");
        assert_eq!(length, Some(body.len() as u64), "{path}");
        let _: Value = serde_json::from_slice(&body).unwrap();
    }
    c.shutdown().await;
}
