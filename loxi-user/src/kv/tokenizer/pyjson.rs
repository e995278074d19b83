//! The template globals transformers adds to its Jinja environment, with Python's exact output:
//! `tojson` (Python `json.dumps` with `ensure_ascii=False` by default: separators `", "` and
//! `": "`, no HTML escaping, non-ASCII kept, map order kept) and `strftime_now(format)`.
//! minijinja's own `tojson` differs (compact separators, HTML-escapes `<>&'`), which would change
//! rendered prompts and so every block hash after the first tool definition.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Options of Python's `json.dumps` that templates pass to `tojson`.
#[derive(Debug, Clone)]
struct DumpOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

/// `value | tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False)` as
/// transformers defines it. Errors name the unsupported argument.
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(usize::try_from(v).unwrap_or(0))),
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_owned()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an int or a string",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = DumpOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    dump(&mut out, &value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

fn dump(out: &mut String, v: &Value, o: &DumpOpts, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => dump_number(out, v),
        ValueKind::String | ValueKind::Bytes => {
            dump_str(out, v.as_str().unwrap_or_default(), o.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            dump_container(out, o, depth, '[', ']', items.len(), |out, i| {
                dump(out, &items[i], o, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            dump_container(out, o, depth, '{', '}', keys.len(), |out, i| {
                let key = &keys[i];
                match key.as_str() {
                    Some(s) => dump_str(out, s, o.ensure_ascii),
                    None => dump_str(out, &key.to_string(), o.ensure_ascii),
                }
                out.push_str(&o.key_sep);
                dump(out, &v.get_item(key)?, o, depth + 1)
            })?;
        }
        _ => dump_str(out, &v.to_string(), o.ensure_ascii),
    }
    Ok(())
}

fn dump_container(
    out: &mut String,
    o: &DumpOpts,
    depth: usize,
    open: char,
    close: char,
    len: usize,
    mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(ind) = &o.indent {
        out.push('\n');
        out.push_str(&ind.repeat(depth));
    }
    out.push(close);
    Ok(())
}

fn dump_number(out: &mut String, v: &Value) {
    if let Ok(i) = i64::try_from(v.clone()) {
        let _ = write!(out, "{i}");
    } else if let Ok(f) = f64::try_from(v.clone()) {
        out.push_str(&py_float(f));
    } else {
        out.push_str(&v.to_string());
    }
}

/// Python `float.__repr__` (what `json.dumps` writes): `1.0`, `0.5`, `1e-07`, `NaN`, `Infinity`.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    let exp = if f == 0.0 {
        0
    } else {
        f.abs().log10().floor() as i32
    };
    if (-4..16).contains(&exp) {
        let s = format!("{f:?}");
        if s.contains('.') || s.contains('e') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        // Rust `{:e}` gives shortest digits like Python; Python pads the exponent to 2 digits.
        let s = format!("{f:e}");
        let (mant, e) = s.split_once('e').unwrap_or((&s, "0"));
        let (sign, digits) = match e.strip_prefix('-') {
            Some(d) => ('-', d),
            None => ('+', e),
        };
        format!("{mant}e{sign}{digits:0>2}")
    }
}

/// A JSON string literal as Python writes it.
fn dump_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `strftime_now(format)`: the current UTC time formatted with the C `strftime` directives
/// templates use (`%Y %y %m %d %e %B %b %h %A %a %H %I %M %S %p %j %F %T %D %%`). Unknown
/// directives are an error naming them.
pub fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime(format, secs as i64)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats Unix time `secs` (UTC) like C `strftime`.
pub fn strftime(format: &str, secs: i64) -> Result<String, Error> {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (sod / 3600, (sod / 60) % 60, sod % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (index 3).
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let spec = chars.next().unwrap_or('%');
        let _ = match spec {
            'Y' => write!(out, "{y}"),
            'y' => write!(out, "{:02}", y.rem_euclid(100)),
            'm' => write!(out, "{m:02}"),
            'd' => write!(out, "{d:02}"),
            'e' => write!(out, "{d:>2}"),
            'B' => write!(out, "{month}"),
            'b' | 'h' => write!(out, "{}", &month[..3]),
            'A' => write!(out, "{}", DAYS[weekday]),
            'a' => write!(out, "{}", &DAYS[weekday][..3]),
            'H' => write!(out, "{hh:02}"),
            'I' => write!(out, "{:02}", if hh % 12 == 0 { 12 } else { hh % 12 }),
            'M' => write!(out, "{mm:02}"),
            'S' => write!(out, "{ss:02}"),
            'p' => write!(out, "{}", if hh < 12 { "AM" } else { "PM" }),
            'j' => write!(out, "{yday:03}"),
            'F' => write!(out, "{y}-{m:02}-{d:02}"),
            'T' => write!(out, "{hh:02}:{mm:02}:{ss:02}"),
            'D' => write!(out, "{m:02}/{d:02}/{:02}", y.rem_euclid(100)),
            '%' => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other}"),
                ));
            }
        };
    }
    Ok(out)
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 → (year, month 1..=12, day).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(src, ctx).expect("renders")
    }

    #[test]
    fn tojson_matches_python_json_dumps_ensure_ascii_false_keeping_key_order() {
        let params = Value::from_iter([
            (
                "b",
                Value::from(vec![
                    Value::from(1),
                    Value::from(2.5),
                    Value::from(true),
                    Value::from(()),
                ]),
            ),
            ("a", Value::from("x\"y\n")),
        ]);
        let v = Value::from_iter([
            ("name", Value::from("get_weather")),
            ("description", Value::from("Wetter <heute> & 北京")),
            ("parameters", params),
        ]);
        // Python: json.dumps(v, ensure_ascii=False)
        assert_eq!(
            render("{{ v | tojson }}", minijinja::context! { v => v }),
            r#"{"name": "get_weather", "description": "Wetter <heute> & 北京", "parameters": {"b": [1, 2.5, true, null], "a": "x\"y\n"}}"#
        );
    }

    #[test]
    fn tojson_indent_sort_keys_and_ensure_ascii_like_python() {
        let v: serde_json::Value = serde_json::from_str(r#"{"b": ["é"], "a": {}}"#).expect("json");
        // Python: json.dumps(v, indent=2, sort_keys=True, ensure_ascii=True)
        assert_eq!(
            render(
                "{{ v | tojson(indent=2, sort_keys=true, ensure_ascii=true) }}",
                minijinja::context! { v => Value::from_serialize(&v) }
            ),
            "{\n  \"a\": {},\n  \"b\": [\n    \"\\u00e9\"\n  ]\n}"
        );
    }

    #[test]
    fn python_float_repr() {
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(0.1), "0.1");
        assert_eq!(py_float(1e-7), "1e-07");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(1e-5), "1e-05");
        assert_eq!(py_float(0.0001), "0.0001");
        assert_eq!(py_float(123456.75), "123456.75");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%d %b %Y", t).expect("ok"), "29 Feb 2024");
        assert_eq!(
            strftime("%A %B %e, %H:%M:%S %p %j %F %%", t).expect("ok"),
            "Thursday February 29, 13:05:09 PM 060 2024-02-29 %"
        );
        assert_eq!(strftime("%d %B %Y", 0).expect("ok"), "01 January 1970");
        assert!(strftime("%Q", t).is_err());
    }
}
