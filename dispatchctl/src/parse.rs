//! Parsers for the values users type on the command line: memory sizes
//! (`512M`, `4G`, `1.5GiB`, plain bytes), durations (`30s`, `5m`, `1h30m`,
//! Slurm's `[D-]HH:MM:SS`) and `KEY=VALUE` pairs (selectors, environment).
//!
//! Each parser returns a [`ParseError`] whose message says what was wrong
//! and what would have been accepted; clap shows it next to the flag.

use std::time::Duration;

/// A value the user typed could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not a size.
    #[error("invalid size {input:?}: {why} (examples: 512M, 4G, 1.5GiB, 1048576)")]
    Size { input: String, why: String },
    /// Not a duration.
    #[error("invalid duration {input:?}: {why} (examples: 30s, 5m, 1h30m, 2d, 01:30:00)")]
    Duration { input: String, why: String },
    /// Not a `KEY=VALUE` pair.
    #[error("invalid {input:?}: {why} (expected KEY=VALUE)")]
    KeyValue { input: String, why: String },
}

/// Parses a memory size in bytes.
///
/// Accepts a non-negative number, optionally fractional, followed by an
/// optional unit: none or `B` for bytes; `K`, `M`, `G`, `T`, `P`, with an
/// optional `i`, `B` or `iB` (`4G`, `4Gi`, `4GB`, `4GiB`). Units are
/// case-insensitive and all are powers of 1024, as in Slurm (`4G` is
/// 4 GiB). A fractional result is rounded down to whole bytes.
pub fn parse_size(input: &str) -> Result<u64, ParseError> {
    let err = |why: &str| ParseError::Size {
        input: input.to_string(),
        why: why.to_string(),
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return Err(err("must start with a number"));
    }
    let unit = unit.trim();
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "ki" | "kb" | "kib" => 10,
        "m" | "mi" | "mb" | "mib" => 20,
        "g" | "gi" | "gb" | "gib" => 30,
        "t" | "ti" | "tb" | "tib" => 40,
        "p" | "pi" | "pb" | "pib" => 50,
        _ => return Err(err(&format!("unknown unit {unit:?}; use K, M, G, T or P"))),
    };
    let multiplier = 1u64 << shift;
    if let Some((int, frac)) = num.split_once('.') {
        if frac.contains('.') || (int.is_empty() && frac.is_empty()) {
            return Err(err("not a number"));
        }
        let int: u64 = if int.is_empty() {
            0
        } else {
            int.parse().map_err(|_| err("not a number"))?
        };
        let whole = int
            .checked_mul(multiplier)
            .ok_or_else(|| err("too large"))?;
        // The fraction, exactly: digits / 10^len * multiplier, rounded down.
        let digits = frac.trim_end_matches('0');
        if digits.len() > 18 {
            return Err(err("too many decimals"));
        }
        let part = if digits.is_empty() {
            0
        } else {
            let d: u128 = digits.parse().map_err(|_| err("not a number"))?;
            let scale = 10u128.pow(digits.len() as u32);
            u64::try_from(d * u128::from(multiplier) / scale).map_err(|_| err("too large"))?
        };
        whole.checked_add(part).ok_or_else(|| err("too large"))
    } else {
        let n: u64 = num.parse().map_err(|_| err("too large"))?;
        n.checked_mul(multiplier).ok_or_else(|| err("too large"))
    }
}

/// Parses a duration.
///
/// Accepts one or more `<number><unit>` parts (`ms`, `s`, `m`, `h`, `d`;
/// e.g. `30s`, `5m`, `1h30m`, `1.5h`), Slurm's clock forms `MM:SS`,
/// `HH:MM:SS` and `D-HH:MM:SS`, or `0` for none. A bare number other than
/// 0 is refused because its unit would be a guess.
pub fn parse_duration(input: &str) -> Result<Duration, ParseError> {
    let err = |why: &str| ParseError::Duration {
        input: input.to_string(),
        why: why.to_string(),
    };
    let s = input.trim();
    if s.is_empty() {
        return Err(err("empty"));
    }
    if s.chars().all(|c| c == '0') {
        return Ok(Duration::ZERO);
    }
    if s.contains(':') {
        return parse_clock(s).ok_or_else(|| err("expected MM:SS, HH:MM:SS or D-HH:MM:SS"));
    }
    if s.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(err("missing unit; write e.g. 30s, 5m or 1h"));
    }
    let mut total_ms: u128 = 0;
    let mut rest = s;
    while !rest.is_empty() {
        let n_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, tail) = rest.split_at(n_end);
        if num.is_empty() {
            return Err(err("expected a number before each unit"));
        }
        let u_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(u_end);
        let unit_ms: u128 = match unit.to_ascii_lowercase().as_str() {
            "ms" => 1,
            "s" | "sec" | "secs" => 1_000,
            "m" | "min" | "mins" => 60_000,
            "h" | "hr" | "hrs" => 3_600_000,
            "d" | "day" | "days" => 86_400_000,
            "" => return Err(err("missing unit after a number")),
            other => {
                return Err(err(&format!(
                    "unknown unit {other:?}; use ms, s, m, h or d"
                )));
            }
        };
        total_ms = total_ms
            .checked_add(scaled(num, unit_ms).ok_or_else(|| err("not a number"))?)
            .ok_or_else(|| err("too large"))?;
        rest = next;
    }
    let ms = u64::try_from(total_ms).map_err(|_| err("too large"))?;
    Ok(Duration::from_millis(ms))
}

/// `num` (decimal, possibly fractional) times `unit`, rounded down.
fn scaled(num: &str, unit: u128) -> Option<u128> {
    match num.split_once('.') {
        None => num.parse::<u128>().ok()?.checked_mul(unit),
        Some((int, frac)) => {
            if frac.contains('.') || (int.is_empty() && frac.is_empty()) || frac.len() > 18 {
                return None;
            }
            let i: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
            let f: u128 = if frac.is_empty() {
                0
            } else {
                frac.parse().ok()?
            };
            let scale = 10u128.pow(frac.len() as u32);
            i.checked_mul(unit)?.checked_add(f * unit / scale)
        }
    }
}

/// `MM:SS`, `HH:MM:SS`, `D-HH:MM:SS` (Slurm's `--time` forms).
fn parse_clock(s: &str) -> Option<Duration> {
    let (days, clock) = match s.split_once('-') {
        Some((d, c)) => (d.parse::<u64>().ok()?, c),
        None => (0, s),
    };
    let parts: Vec<&str> = clock.split(':').collect();
    let nums: Option<Vec<u64>> = parts
        .iter()
        .map(|p| {
            if p.is_empty() || !p.chars().all(|c| c.is_ascii_digit()) {
                None
            } else {
                p.parse().ok()
            }
        })
        .collect();
    let nums = nums?;
    let (h, m, sec) = match nums.as_slice() {
        [m, s] => (0, *m, *s),
        [h, m, s] => (*h, *m, *s),
        _ => return None,
    };
    if (nums.len() == 3 && m >= 60) || sec >= 60 {
        return None;
    }
    let secs = days
        .checked_mul(86_400)?
        .checked_add(h.checked_mul(3_600)?)?
        .checked_add(m.checked_mul(60)?)?
        .checked_add(sec)?;
    Some(Duration::from_secs(secs))
}

/// A `KEY=VALUE` pair from `--selector` or `--env`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// Non-empty, without `=`.
    pub key: String,
    /// Everything after the first `=` (may be empty, may contain `=`).
    pub value: String,
}

/// Parses `KEY=VALUE`: the key is everything before the first `=` and must
/// be non-empty and free of whitespace; the value is the rest, possibly
/// empty.
pub fn parse_key_value(input: &str) -> Result<KeyValue, ParseError> {
    let err = |why: &str| ParseError::KeyValue {
        input: input.to_string(),
        why: why.to_string(),
    };
    let (key, value) = input.split_once('=').ok_or_else(|| err("missing '='"))?;
    if key.is_empty() {
        return Err(err("empty key"));
    }
    if key.chars().any(char::is_whitespace) {
        return Err(err("the key contains whitespace"));
    }
    Ok(KeyValue {
        key: key.to_string(),
        value: value.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("100B"), Ok(100));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("4Gi"), Ok(4 << 30));
        assert_eq!(parse_size("4GB"), Ok(4 << 30));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert_eq!(parse_size("0.5K"), Ok(512));
        assert_eq!(parse_size(".5K"), Ok(512));
        assert_eq!(parse_size("1.0009K"), Ok(1024));
        assert_eq!(parse_size(" 8 M "), Ok(8 << 20));
    }

    #[test]
    fn bad_sizes() {
        for bad in [
            "", "M", "-1", "-4G", "4X", "4 GB B", "1.2.3G", ".", "4Gx", "abc", "1e9",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be refused");
        }
        // Overflow is an error, not a wrap.
        assert!(parse_size("18446744073709551616").is_err());
        assert!(parse_size("16777216T").is_err());
        assert!(parse_size("99999999P").is_err());
        let msg = parse_size("4X").unwrap_err().to_string();
        assert!(msg.contains("unknown unit \"X\""), "{msg}");
    }

    #[test]
    fn durations() {
        let s = Duration::from_secs;
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("30s"), Ok(s(30)));
        assert_eq!(parse_duration("5m"), Ok(s(300)));
        assert_eq!(parse_duration("1h"), Ok(s(3600)));
        assert_eq!(parse_duration("2d"), Ok(s(2 * 86_400)));
        assert_eq!(parse_duration("1h30m"), Ok(s(5400)));
        assert_eq!(parse_duration("1h30m15s"), Ok(s(5415)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1.5h"), Ok(s(5400)));
        assert_eq!(parse_duration("10min"), Ok(s(600)));
        assert_eq!(parse_duration("90S"), Ok(s(90)));
        assert_eq!(parse_duration("05:00"), Ok(s(300)));
        assert_eq!(parse_duration("01:30:00"), Ok(s(5400)));
        assert_eq!(parse_duration("1-00:00:10"), Ok(s(86_410)));
    }

    #[test]
    fn bad_durations() {
        for bad in [
            "",
            "30",
            "s",
            "5x",
            "1h-",
            "-5s",
            "1:2:3:4",
            "00:60",
            "01:60:00",
            "1.2.3s",
            "h5",
            "1-",
            "a-01:00:00",
            ":30",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be refused");
        }
        let msg = parse_duration("30").unwrap_err().to_string();
        assert!(msg.contains("missing unit"), "{msg}");
        assert!(parse_duration("99999999999999999999d").is_err());
    }

    #[test]
    fn key_values() {
        let kv = |k: &str, v: &str| KeyValue {
            key: k.into(),
            value: v.into(),
        };
        assert_eq!(parse_key_value("zone=z1"), Ok(kv("zone", "z1")));
        assert_eq!(parse_key_value("A="), Ok(kv("A", "")));
        assert_eq!(parse_key_value("OPTS=a=b,c"), Ok(kv("OPTS", "a=b,c")));
        assert_eq!(
            parse_key_value("topology.kubernetes.io/zone=eu-1a"),
            Ok(kv("topology.kubernetes.io/zone", "eu-1a"))
        );
        assert_eq!(parse_key_value("K=with space"), Ok(kv("K", "with space")));
        for bad in ["", "novalue", "=v", "a b=c"] {
            assert!(parse_key_value(bad).is_err(), "{bad:?} should be refused");
        }
        let msg = parse_key_value("novalue").unwrap_err().to_string();
        assert!(
            msg.contains("missing '='") && msg.contains("KEY=VALUE"),
            "{msg}"
        );
    }
}
