//! OpenMetrics text → Prometheus text format 0.0.4.
//!
//! `prometheus-client` writes OpenMetrics: a counter family is declared as `# TYPE x counter`
//! with samples `x_total`, info families as `x` with samples `x_info`, plus `# UNIT` and
//! `# EOF` lines. The 0.0.4 parser (used by `promtool check metrics`) wants the family name to
//! equal the sample name, so counters are renamed to `x_total`, info becomes a gauge `x_info`,
//! `unknown` becomes `untyped`, `_created` samples, `# UNIT` and `# EOF` are dropped.

/// One family as read from OpenMetrics text.
#[derive(Default)]
struct Family<'a> {
    name: &'a str,
    help: Option<&'a str>,
    kind: &'a str,
    samples: Vec<&'a str>,
}

/// Converts OpenMetrics text (as [`super::encode`] produces) to the 0.0.4 text format.
pub fn openmetrics_to_text(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut fam: Option<Family<'_>> = None;
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            flush(&mut out, fam.take());
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            fam = Some(Family {
                name,
                help: Some(help),
                kind: "untyped",
                ..Default::default()
            });
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            if fam.as_ref().is_none_or(|f| f.name != name) {
                flush(&mut out, fam.take());
                fam = Some(Family {
                    name,
                    ..Default::default()
                });
            }
            if let Some(f) = fam.as_mut() {
                f.kind = kind;
            }
        } else if line.starts_with("# ") || line.is_empty() {
            continue; // # UNIT, # EOF
        } else if let Some(f) = fam.as_mut() {
            f.samples.push(line);
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    flush(&mut out, fam);
    out
}

fn flush(out: &mut String, fam: Option<Family<'_>>) {
    let Some(f) = fam else { return };
    let (name, kind) = match f.kind {
        "counter" if !f.name.ends_with("_total") => (format!("{}_total", f.name), "counter"),
        "info" => (format!("{}_info", f.name), "gauge"),
        "unknown" => (f.name.to_string(), "untyped"),
        k => (f.name.to_string(), k),
    };
    if let Some(help) = f.help {
        out.push_str(&format!("# HELP {name} {help}\n"));
    }
    out.push_str(&format!("# TYPE {name} {kind}\n"));
    let created = format!("{}_created", f.name);
    for s in f.samples.iter().filter(|s| !s.starts_with(&created)) {
        out.push_str(s);
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_renamed_to_their_total_sample_name() {
        let om = "# HELP req Requests.\n# TYPE req counter\nreq_total{a=\"1\"} 2\nreq_created{a=\"1\"} 1.7e9\n# HELP up Up.\n# TYPE up gauge\nup 1\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(om),
            "# HELP req_total Requests.\n# TYPE req_total counter\nreq_total{a=\"1\"} 2\n# HELP up Up.\n# TYPE up gauge\nup 1\n"
        );
    }

    #[test]
    fn histograms_units_and_info_convert() {
        let om = "# HELP d_seconds Duration.\n# TYPE d_seconds histogram\n# UNIT d_seconds seconds\nd_seconds_sum 1.5\nd_seconds_count 2\nd_seconds_bucket{le=\"+Inf\"} 2\n# HELP b Build.\n# TYPE b info\nb_info{v=\"1\"} 1\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(om),
            "# HELP d_seconds Duration.\n# TYPE d_seconds histogram\nd_seconds_sum 1.5\nd_seconds_count 2\nd_seconds_bucket{le=\"+Inf\"} 2\n# HELP b_info Build.\n# TYPE b_info gauge\nb_info{v=\"1\"} 1\n"
        );
    }
}
