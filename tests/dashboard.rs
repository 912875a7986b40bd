//! The Grafana dashboard as Grafana reads it: unique panel ids, panels that do not overlap,
//! every query on the chosen data source and instance variable, rate windows that follow the
//! scrape interval (`$__rate_interval`), and one unit per panel axis. (That every metric it
//! names is exported is checked against a real sidecar and a real engine in sidecar_process.rs
//! and engine_http.rs.)

use serde_json::Value;

fn dashboard() -> Value {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/kvtier.json")).unwrap();
    serde_json::from_str(&text).expect("deploy/grafana/kvtier.json is JSON")
}

/// Every `[...]` range selector in a PromQL expression.
fn ranges(expr: &str) -> Vec<&str> {
    expr.match_indices('[')
        .map(|(i, _)| &expr[i + 1..i + expr[i..].find(']').expect("a closed range")])
        .collect()
}

#[test]
fn the_dashboard_is_well_formed_and_each_axis_has_one_unit() {
    let d = dashboard();
    let panels = d["panels"].as_array().unwrap();
    let variables: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(variables, ["datasource", "instance", "engine"]);

    let mut ids = std::collections::HashSet::new();
    let mut cells = std::collections::HashSet::new();
    for p in panels {
        let title = p["title"].as_str().unwrap();
        assert!(ids.insert(p["id"].as_u64().unwrap()), "{title}: id used twice");
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(x + w <= 24 && w > 0 && h > 0, "{title}: {g}");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(
                    cells.insert((cx, cy)),
                    "{title} overlaps another panel at ({cx}, {cy})"
                );
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        assert!(
            p["fieldConfig"]["defaults"]["unit"].is_string(),
            "{title}: no unit"
        );
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title}: no query");
        let mut quantiles = 0;
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            let variable = if expr.contains("kvtier_engine_") {
                "$engine"
            } else {
                "$instance"
            };
            assert!(
                expr.contains(&format!("instance=~\"{variable}\"")),
                "{title}: {expr} is not filtered by {variable}"
            );
            for r in ranges(expr) {
                assert_eq!(r, "$__rate_interval", "{title}: a fixed window in {expr}");
            }
            quantiles += usize::from(expr.contains("histogram_quantile"));
        }
        // A latency quantile (seconds) and a rate or count on one axis would share a unit.
        assert!(
            quantiles == 0 || quantiles == targets.len(),
            "{title}: mixes latency quantiles with other queries on one axis"
        );
    }
    assert!(
        panels
            .iter()
            .any(|p| p["type"] == "row" && p["title"] == "Engine")
    );
}
