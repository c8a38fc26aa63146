//! `leasecore serve --config FILE`: every serve flag in a TOML file, for hosts managed by
//! systemd or configuration management.
//!
//! Precedence is flags, then environment (`LEASECORE_*`), then the file, then the built-in
//! defaults. That is exactly clap's order for a flag, its `env`, and its default value, so the
//! file's values become the defaults of the `serve` command before the final parse: clap then
//! applies the flags and the environment over them, and `--help` shows the file's values as
//! the defaults.
//!
//! Keys are the flags' long names without the dashes, in snake_case or kebab-case
//! (`heartbeat_ms` or `heartbeat-ms`). A key that is no serve flag is an error (a typo must not
//! be silently ignored). `--peers` may be a table (`[peers] 1 = "10.0.0.1:7001"`).
//!
//! `serve --dry-run` prints the settings in force, each with where it came from, in the same
//! format: the output is itself a valid configuration file.
//!
//! # What it must not do
//! Interpret values: clap parses and validates them as it does flags, with the same messages.

use std::collections::BTreeMap;
use std::path::Path;

use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

/// The arguments of `serve` that are not settings.
const NOT_SETTINGS: &[&str] = &["config", "dry_run", "help", "version"];

/// A configuration file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not valid TOML: {message}")]
    Syntax { path: String, message: String },
    #[error("{path}: unknown key {key:?} (the keys are serve's flags: {known})")]
    UnknownKey {
        path: String,
        key: String,
        known: String,
    },
    #[error("{path}: {key}: {message}")]
    Value {
        path: String,
        key: String,
        message: String,
    },
}

/// The setting names of `serve` (its argument ids).
pub fn setting_names(serve: &Command) -> Vec<String> {
    serve
        .get_arguments()
        .map(|a| a.get_id().as_str().to_string())
        .filter(|id| !NOT_SETTINGS.contains(&id.as_str()))
        .collect()
}

/// Read `path` into setting name → the value as it would be written on the command line.
pub fn load(path: &Path, serve: &Command) -> Result<BTreeMap<String, String>, ConfigError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: shown.clone(),
        source,
    })?;
    parse(&text, &shown, serve)
}

/// [`load`] on text already read (`path` only names it in errors).
pub fn parse(
    text: &str,
    path: &str,
    serve: &Command,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError::Syntax {
            path: path.to_string(),
            message: e.message().to_string(),
        })?;
    let known = setting_names(serve);
    let mut settings = BTreeMap::new();
    for (key, value) in table {
        let name = key.replace('-', "_");
        if !known.contains(&name) {
            return Err(ConfigError::UnknownKey {
                path: path.to_string(),
                key,
                known: known.join(", "),
            });
        }
        let text = as_flag_value(&value)
            .and_then(|text| check_value(serve, &name, &text).map(|()| text))
            .map_err(|message| ConfigError::Value {
                path: path.to_string(),
                key: key.clone(),
                message,
            })?;
        settings.insert(name, text);
    }
    Ok(settings)
}

/// Parse `text` as the flag `name` would be (so that a bad value is reported against the
/// file and its key, not against a flag nobody typed).
fn check_value(serve: &Command, name: &str, text: &str) -> Result<(), String> {
    let Some(arg) = serve.get_arguments().find(|a| a.get_id() == name) else {
        return Ok(());
    };
    if !arg.get_action().takes_values() {
        // An on/off flag: the words its environment variable takes.
        return match text {
            "true" | "false" | "1" | "0" | "yes" | "no" | "on" | "off" => Ok(()),
            other => Err(format!("{other:?} is not a boolean (true or false)")),
        };
    }
    let Some(long) = arg.get_long() else {
        return Ok(());
    };
    // A command of that one flag, parsed as if typed: clap's own checks and messages.
    let probe = Command::new("config")
        .no_binary_name(true)
        .arg(arg.clone().env(None::<&str>).required(false));
    match probe.try_get_matches_from([format!("--{long}"), text.to_string()]) {
        Ok(_) => Ok(()),
        Err(e) => {
            let shown = e.to_string();
            let first = shown.lines().next().unwrap_or_default();
            let first = first.trim_start_matches("error: ");
            // "invalid value 'x' for '--flag <FLAG>': why" -> "invalid value 'x': why"
            let mut message = match (first.find(" for '"), first.rfind("':")) {
                (Some(a), Some(b)) if b > a => format!("{}{}", &first[..a], &first[b + 1..]),
                (Some(a), _) => first[..a].to_string(),
                _ => first.to_string(),
            };
            if let Some(possible) = shown.lines().find(|l| l.contains("[possible values")) {
                message.push(' ');
                message.push_str(possible.trim());
            }
            Err(message)
        }
    }
}

/// A TOML value as flag text: scalars as written, arrays comma-separated, a table as
/// `key=value,...` (the form of `--peers`).
fn as_flag_value(value: &toml::Value) -> Result<String, String> {
    use toml::Value;
    let scalar = |v: &Value| -> Result<String, String> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Integer(i) => Ok(i.to_string()),
            Value::Float(f) => Ok(f.to_string()),
            Value::Boolean(b) => Ok(b.to_string()),
            other => Err(format!("expected a string, number or boolean, got {other}")),
        }
    };
    match value {
        Value::Array(items) => Ok(items
            .iter()
            .map(scalar)
            .collect::<Result<Vec<_>, _>>()?
            .join(",")),
        Value::Table(t) => Ok(t
            .iter()
            .map(|(k, v)| scalar(v).map(|v| format!("{k}={v}")))
            .collect::<Result<Vec<_>, _>>()?
            .join(",")),
        v => scalar(v),
    }
}

/// `serve` with `settings` as its defaults (flags and environment still override them).
pub fn with_defaults(serve: Command, settings: &BTreeMap<String, String>) -> Command {
    settings.iter().fold(serve, |cmd, (name, value)| {
        let value = value.clone();
        cmd.mut_arg(name.as_str(), move |arg| arg.default_value(value))
    })
}

/// The settings in force as a configuration file, each with where it came from (`--dry-run`).
pub fn render(
    serve: &Command,
    matches: &ArgMatches,
    file: Option<(&Path, &BTreeMap<String, String>)>,
) -> String {
    let mut out = String::from("# the settings in force: flags > environment > file > defaults\n");
    for name in setting_names(serve) {
        let raw: Option<Vec<String>> = matches
            .get_raw(&name)
            .map(|values| values.map(|v| v.to_string_lossy().into_owned()).collect());
        let source = match matches.value_source(&name) {
            Some(ValueSource::CommandLine) => "flag".to_string(),
            Some(ValueSource::EnvVariable) => "environment".to_string(),
            // A default is the file's when the file set it.
            Some(ValueSource::DefaultValue) => match file {
                Some((path, settings)) if settings.contains_key(&name) => {
                    path.display().to_string()
                }
                _ => "default".to_string(),
            },
            _ => "default".to_string(),
        };
        match raw {
            Some(values) => {
                let joined = values.join(",");
                out.push_str(&format!("{name} = {}  # {source}\n", toml_scalar(&joined)));
            }
            None => out.push_str(&format!("# {name} =  (not set)\n")),
        }
    }
    out
}

/// A value as TOML: numbers and booleans bare, everything else a quoted string.
fn toml_scalar(v: &str) -> String {
    if v == "true" || v == "false" || (v.parse::<i64>().is_ok() && !v.starts_with('+')) {
        v.to_string()
    } else {
        toml::Value::String(v.to_string()).to_string()
    }
}
