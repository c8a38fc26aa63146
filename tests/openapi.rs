//! Keeps `api/openapi.yaml` honest: it documents exactly the public routes of
//! `leasecore::http::route_table()`, each operation is well formed, every `$ref` resolves, and
//! every error code the HTTP layer can send is documented.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use leasecore::http::{Audience, route_table};
use serde_json::Value;

/// The operation keys of an OpenAPI path item.
const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// `(METHOD, path template)`, e.g. `("GET", "/v1/kv/{key}")`.
type Operation = (String, String);

fn repo_file(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// The document, as JSON values (status codes must be quoted, as OpenAPI recommends).
fn document() -> Value {
    let path = repo_file("api/openapi.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let doc: Value = serde_yaml_ng::from_str(&text).unwrap_or_else(|e| {
        panic!("api/openapi.yaml is not valid YAML (are all status codes quoted?): {e}")
    });
    assert_eq!(
        doc["openapi"], "3.0.3",
        "the document must be OpenAPI 3.0.3"
    );
    doc
}

/// Every operation of the document with its path item.
fn documented(doc: &Value) -> BTreeMap<Operation, (&Value, &Value)> {
    let paths = doc["paths"].as_object().expect("`paths` must be a mapping");
    let mut ops = BTreeMap::new();
    for (path, item) in paths {
        for method in METHODS {
            if let Some(op) = item.get(method) {
                ops.insert((method.to_uppercase(), path.clone()), (item, op));
            }
        }
    }
    ops
}

/// Every public route the router serves, with axum's `{*name}` written as OpenAPI's `{name}`.
fn served() -> BTreeSet<Operation> {
    route_table()
        .into_iter()
        .filter(|r| r.audience == Audience::Public)
        .map(|r| (r.method.to_string(), r.path.replace("{*", "{")))
        .collect()
}

/// The `{name}` parameters of a path template.
fn template_params(path: &str) -> BTreeSet<String> {
    path.split('/')
        .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
        .map(str::to_string)
        .collect()
}

/// Follow a local `$ref` (`#/a/b/c`); `None` if it does not resolve.
fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    doc.pointer(reference.strip_prefix('#')?)
}

/// A value, or what its `$ref` points at.
fn deref<'a>(doc: &'a Value, v: &'a Value) -> &'a Value {
    match v.get("$ref").and_then(Value::as_str) {
        Some(r) => resolve(doc, r).unwrap_or_else(|| panic!("unresolved $ref {r}")),
        None => v,
    }
}

/// The names of the `in: path` parameters declared on a path item and its operation.
fn declared_path_params(doc: &Value, item: &Value, op: &Value) -> BTreeSet<String> {
    [item, op]
        .into_iter()
        .filter_map(|v| v.get("parameters").and_then(Value::as_array))
        .flatten()
        .map(|p| deref(doc, p))
        .filter(|p| p["in"] == "path")
        .map(|p| {
            p["name"]
                .as_str()
                .expect("a parameter needs a name")
                .to_string()
        })
        .collect()
}

#[test]
fn document_describes_exactly_the_public_routes() {
    let doc = document();
    let in_doc: BTreeSet<Operation> = documented(&doc).into_keys().collect();
    let in_router = served();

    let undocumented: Vec<_> = in_router.difference(&in_doc).collect();
    let not_served: Vec<_> = in_doc.difference(&in_router).collect();
    assert!(
        undocumented.is_empty() && not_served.is_empty(),
        "api/openapi.yaml and route_table() disagree\n  \
         served but not documented: {undocumented:?}\n  \
         documented but not served: {not_served:?}"
    );
}

#[test]
fn every_operation_declares_its_path_parameters_and_a_success() {
    let doc = document();
    let mut problems = Vec::new();
    for ((method, path), (item, op)) in documented(&doc) {
        let used = template_params(&path);
        let declared = declared_path_params(&doc, item, op);
        for missing in used.difference(&declared) {
            problems.push(format!(
                "{method} {path}: path parameter {{{missing}}} not declared"
            ));
        }
        for extra in declared.difference(&used) {
            problems.push(format!(
                "{method} {path}: declares path parameter {extra:?} not in the path"
            ));
        }
        let responses = op["responses"].as_object();
        let has_2xx = responses.is_some_and(|r| r.keys().any(|status| status.starts_with('2')));
        if !has_2xx {
            problems.push(format!("{method} {path}: no 2xx response"));
        }
    }
    assert!(
        problems.is_empty(),
        "malformed operations:\n  {}",
        problems.join("\n  ")
    );
}

#[test]
fn every_ref_resolves() {
    fn walk<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    out.push(r);
                }
                m.values().for_each(|v| walk(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let doc = document();
    let mut refs = Vec::new();
    walk(&doc, &mut refs);
    let broken: BTreeSet<_> = refs
        .into_iter()
        .filter(|r| resolve(&doc, r).is_none())
        .collect();
    assert!(broken.is_empty(), "unresolved $refs: {broken:?}");
}

/// The error codes the HTTP layer can send: the string literal that is the code argument of
/// every `ApiError::new(status, "code", ..)`, `Self::new(..)` and `ApiError::not_found("code", ..)`
/// in `src/http/*.rs`.
fn codes_in_source() -> BTreeSet<String> {
    const CONSTRUCTORS: [&str; 4] = [
        "ApiError::new(",
        "Self::new(",
        "ApiError::not_found(",
        "Self::not_found(",
    ];
    let dir = repo_file("src/http");
    let mut codes = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).expect("read src/http") {
        let path = entry.expect("dir entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read source");
        for ctor in CONSTRUCTORS {
            for (at, _) in text.match_indices(ctor) {
                let args = call_arguments(&text[at + ctor.len()..]);
                if let Some(code) = first_string_literal(args)
                    && is_snake_case(code)
                {
                    codes.insert(code.to_string());
                }
            }
        }
    }
    codes
}

/// The text of a call's arguments, given the text just after its `(`.
fn call_arguments(after_paren: &str) -> &str {
    let (mut depth, mut in_string, mut escaped) = (1, false, false);
    for (i, c) in after_paren.char_indices() {
        match (in_string, c) {
            (true, _) if escaped => escaped = false,
            (true, '\\') => escaped = true,
            (true, '"') => in_string = false,
            (true, _) => {}
            (false, '"') => in_string = true,
            (false, '(') => depth += 1,
            (false, ')') => {
                depth -= 1;
                if depth == 0 {
                    return &after_paren[..i];
                }
            }
            _ => {}
        }
    }
    after_paren
}

fn first_string_literal(text: &str) -> Option<&str> {
    let start = text.find('"')? + 1;
    let len = text[start..].find('"')?;
    Some(&text[start..start + len])
}

fn is_snake_case(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c == '_')
}

/// Every value listed in the `enum` of a property named `code` anywhere in the document.
fn codes_in_document(doc: &Value) -> BTreeSet<String> {
    fn walk(v: &Value, out: &mut BTreeSet<String>) {
        match v {
            Value::Object(m) => {
                if let Some(values) = m
                    .get("code")
                    .and_then(|c| c.get("enum"))
                    .and_then(Value::as_array)
                {
                    out.extend(values.iter().filter_map(Value::as_str).map(str::to_string));
                }
                m.values().for_each(|v| walk(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = BTreeSet::new();
    walk(doc, &mut out);
    out
}

#[test]
fn every_error_code_is_documented() {
    let in_source = codes_in_source();
    // Guard the scanner itself: these certainly exist.
    for known in [
        "invalid_argument",
        "too_large",
        "no_leader",
        "key_not_found",
    ] {
        assert!(
            in_source.contains(known),
            "the source scan missed {known:?}; found {in_source:?}"
        );
    }
    let in_doc = codes_in_document(&document());
    let undocumented: Vec<_> = in_source.difference(&in_doc).collect();
    assert!(
        undocumented.is_empty(),
        "error codes sent by src/http but not listed in any `code` enum of api/openapi.yaml: \
         {undocumented:?}"
    );
}
