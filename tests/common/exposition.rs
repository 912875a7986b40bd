//! A checker of Prometheus' text exposition format: what `promtool check metrics` rejects or
//! lints, for the tests that scrape kvtier's two `/metrics` endpoints (no promtool needed).
//!
//! Checked: every line is a comment, a `# HELP`/`# TYPE` line or a sample; a family's `HELP`
//! and `TYPE` come once each and before its samples, and its lines are not split by another
//! family's; names and label names are valid, label values properly quoted, values numbers;
//! no series twice; every family has help text; counters end in `_total` and nothing else
//! does; no non-base units; histograms have `le` buckets ending at `+Inf`, cumulative, with
//! `_count` equal to the `+Inf` bucket; summaries' `quantile` labels are numbers.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};

/// A series' labels, as exposed.
pub type Labels = Vec<(String, String)>;
/// One sample: (sample name, labels, value).
pub type Sample = (String, Labels, f64);

/// One metric family as exposed.
#[derive(Debug, Default, Clone)]
pub struct Family {
    pub kind: String,
    pub help: Option<String>,
    /// Samples, as (sample name, labels, value).
    pub samples: Vec<Sample>,
}

/// The families of `text` by name, or every problem found (one line each).
pub fn check(text: &str) -> Result<BTreeMap<String, Family>, Vec<String>> {
    let mut errors = Vec::new();
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut closed: HashSet<String> = HashSet::new();
    let mut current: Option<String> = None;
    let mut series: HashSet<String> = HashSet::new();
    for (n, line) in text.lines().enumerate() {
        let n = n + 1;
        let mut err = |m: String| errors.push(format!("line {n}: {m}: {line:?}"));
        if line.trim().is_empty() {
            continue;
        }
        let (family, sample) = if let Some(rest) = line.strip_prefix('#') {
            let mut words = rest.trim_start().splitn(3, ' ');
            let keyword = words.next().unwrap_or("");
            if keyword != "HELP" && keyword != "TYPE" {
                continue; // a plain comment
            }
            let Some(name) = words.next().filter(|w| valid_name(w)) else {
                err(format!("{keyword} without a valid metric name"));
                continue;
            };
            let value = words.next().unwrap_or("").to_owned();
            let f = families.entry(name.to_owned()).or_default();
            if keyword == "HELP" {
                if f.help.is_some() {
                    err(format!("second HELP for {name}"));
                }
                if !f.samples.is_empty() {
                    err(format!("HELP for {name} after its samples"));
                }
                f.help = Some(value);
            } else {
                if !matches!(
                    value.as_str(),
                    "counter" | "gauge" | "histogram" | "summary" | "untyped"
                ) {
                    err(format!("unknown type {value:?}"));
                }
                if !f.kind.is_empty() {
                    err(format!("second TYPE for {name}"));
                }
                if !f.samples.is_empty() {
                    err(format!("TYPE for {name} after its samples"));
                }
                f.kind = value;
            }
            (name.to_owned(), None)
        } else {
            match parse_sample(line) {
                Ok((name, labels, value)) => {
                    let family = family_of(&name, &families);
                    let mut key: Vec<_> = labels.clone();
                    key.sort();
                    if !series.insert(format!("{name}{key:?}")) {
                        err(format!("series {name}{key:?} appears twice"));
                    }
                    (family, Some((name, labels, value)))
                }
                Err(m) => {
                    err(m);
                    continue;
                }
            }
        };
        if current.as_deref() != Some(family.as_str()) {
            if closed.contains(&family) {
                err(format!("{family}'s lines are split by another family's"));
            }
            if let Some(c) = current.take() {
                closed.insert(c);
            }
            current = Some(family.clone());
        }
        if let Some(s) = sample {
            families.entry(family).or_default().samples.push(s);
        }
    }
    for (name, f) in &families {
        lint(name, f, &mut errors);
    }
    if errors.is_empty() {
        Ok(families)
    } else {
        Err(errors)
    }
}

fn valid_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

fn valid_label_name(s: &str) -> bool {
    valid_name(s) && !s.contains(':')
}

/// The family a sample belongs to: its own name, or a histogram's or summary's base name.
fn family_of(name: &str, families: &BTreeMap<String, Family>) -> String {
    if families.get(name).is_some_and(|f| !f.kind.is_empty()) {
        return name.to_owned();
    }
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(base) = name.strip_suffix(suffix)
            && let Some(f) = families.get(base)
            && (f.kind == "histogram" || (f.kind == "summary" && suffix != "_bucket"))
        {
            return base.to_owned();
        }
    }
    name.to_owned()
}

fn parse_sample(line: &str) -> Result<Sample, String> {
    let end = line.find(['{', ' ']).ok_or("a sample without a value")?;
    let name = &line[..end];
    if !valid_name(name) {
        return Err(format!("invalid metric name {name:?}"));
    }
    let mut rest = &line[end..];
    let mut labels = Vec::new();
    if let Some(r) = rest.strip_prefix('{') {
        let mut r = r;
        loop {
            r = r.trim_start();
            if let Some(after) = r.strip_prefix('}') {
                rest = after;
                break;
            }
            let eq = r.find('=').ok_or("a label without '='")?;
            let label = r[..eq].trim();
            if !valid_label_name(label) || label.starts_with("__") {
                return Err(format!("invalid label name {label:?}"));
            }
            if labels.iter().any(|(l, _): &(String, String)| l == label) {
                return Err(format!("label {label} twice"));
            }
            r = r[eq + 1..].trim_start();
            let mut chars = r.char_indices();
            if chars.next().map(|(_, c)| c) != Some('"') {
                return Err(format!("label {label}'s value is not quoted"));
            }
            let mut value = String::new();
            let mut close = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '"' => {
                        close = Some(i);
                        break;
                    }
                    '\\' => match chars.next().map(|(_, c)| c) {
                        Some('\\') => value.push('\\'),
                        Some('"') => value.push('"'),
                        Some('n') => value.push('\n'),
                        other => return Err(format!("bad escape \\{other:?} in label {label}")),
                    },
                    '\n' => return Err(format!("newline in label {label}")),
                    c => value.push(c),
                }
            }
            let close = close.ok_or_else(|| format!("label {label}'s value is not closed"))?;
            labels.push((label.to_owned(), value));
            r = r[close + 1..].trim_start();
            if let Some(after) = r.strip_prefix(',') {
                r = after;
            } else if !r.starts_with('}') {
                return Err("labels not separated by ','".into());
            }
        }
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().ok_or("a sample without a value")?;
    let value = parse_value(value).ok_or_else(|| format!("value {value:?} is not a number"))?;
    if let Some(ts) = fields.next()
        && ts.parse::<i64>().is_err()
    {
        return Err(format!("timestamp {ts:?} is not an integer"));
    }
    if fields.next().is_some() {
        return Err("text after the timestamp".into());
    }
    Ok((name.to_owned(), labels, value))
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

fn lint(name: &str, f: &Family, errors: &mut Vec<String>) {
    let mut err = |m: String| errors.push(format!("{name}: {m}"));
    if f.help.as_deref().is_none_or(|h| h.trim().is_empty()) {
        err("no help text".into());
    }
    if f.kind.is_empty() {
        err("no TYPE".into());
    }
    if f.samples.is_empty() {
        err("a family without samples".into());
    }
    if name.chars().any(|c| c.is_ascii_uppercase()) {
        err("not snake_case".into());
    }
    let is_counter = f.kind == "counter";
    if is_counter != name.ends_with("_total") {
        err(if is_counter {
            "a counter's name should end in _total".into()
        } else {
            format!("a {} should not end in _total", f.kind)
        });
    }
    for unit in [
        "_milliseconds",
        "_microseconds",
        "_nanoseconds",
        "_minutes",
        "_hours",
        "_kilobytes",
        "_megabytes",
        "_gigabytes",
        "_kib",
        "_mib",
        "_gib",
    ] {
        if name.contains(unit) {
            err(format!("use base units, not {unit}"));
        }
    }
    match f.kind.as_str() {
        "histogram" => lint_histogram(f, &mut err),
        "summary" => {
            for (sample, labels, _) in &f.samples {
                if sample == name
                    && !labels
                        .iter()
                        .any(|(l, v)| l == "quantile" && parse_value(v).is_some())
                {
                    err(format!("summary sample {sample} without a numeric quantile"));
                }
            }
        }
        _ => {
            for (sample, _, _) in &f.samples {
                if sample != name {
                    err(format!("sample {sample} in a {} family", f.kind));
                }
            }
        }
    }
}

fn lint_histogram(f: &Family, err: &mut impl FnMut(String)) {
    // Per label set (without `le`): buckets in order, the +Inf bucket and _count.
    type Buckets = (Vec<(f64, f64)>, Option<f64>);
    let mut sets: HashMap<Labels, Buckets> = HashMap::new();
    for (sample, labels, value) in &f.samples {
        let mut rest: Vec<_> = labels.iter().filter(|(l, _)| l != "le").cloned().collect();
        rest.sort();
        let entry = sets.entry(rest).or_default();
        if sample.ends_with("_bucket") {
            let Some(le) = labels
                .iter()
                .find(|(l, _)| l == "le")
                .and_then(|(_, v)| parse_value(v))
            else {
                err(format!("bucket {sample} without a numeric le"));
                continue;
            };
            entry.0.push((le, *value));
        } else if sample.ends_with("_count") {
            entry.1 = Some(*value);
        } else if !sample.ends_with("_sum") {
            err(format!("sample {sample} in a histogram"));
        }
    }
    for (labels, (mut buckets, count)) in sets {
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        if buckets.last().is_none_or(|b| b.0 != f64::INFINITY) {
            err(format!("{labels:?}: no +Inf bucket"));
        }
        if buckets.windows(2).any(|w| w[1].1 < w[0].1) {
            err(format!("{labels:?}: buckets are not cumulative"));
        }
        if count.is_none() || buckets.last().map(|b| b.1) != count {
            err(format!("{labels:?}: _count is not the +Inf bucket"));
        }
    }
}

/// The metric names the Grafana dashboard queries: (the engine's, the sidecar's).
pub fn dashboard_names() -> (Vec<String>, Vec<String>) {
    let dashboard =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/kvtier.json")).unwrap();
    let mut names: Vec<String> = dashboard
        .match_indices("kvtier_")
        .map(|(i, _)| {
            dashboard[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect();
    names.sort();
    names.dedup();
    names.into_iter().partition(|n| n.starts_with("kvtier_engine_"))
}

/// Whether `name` (a family, or a histogram's `_bucket`/`_sum`/`_count` series) is exposed.
pub fn exposes(families: &BTreeMap<String, Family>, name: &str) -> bool {
    families.contains_key(name)
        || ["_bucket", "_sum", "_count"].iter().any(|s| {
            name.strip_suffix(s)
                .and_then(|base| families.get(base))
                .is_some_and(|f| f.kind == "histogram" || (f.kind == "summary" && *s != "_bucket"))
        })
}
