//! The one grammar for sizes and durations: every `serve` flag, TOML key,
//! admin-socket argument and `rebound query` option that takes one parses
//! it here, so `1.5s` or `1GiB` means the same wherever it is written.
//!
//! | kind | grammar | examples |
//! |---|---|---|
//! | size | digits, optional unit: none/`B`, `K`/`KB`/`KiB`, `M`.., `G`.., `T`.. (binary, case-insensitive) | `4096`, `512K`, `256M`, `1GiB` |
//! | duration | a decimal number, a unit: `ns`, `us`/`µs`, `ms`, `s`, `m`, `h` | `20ms`, `1.5s`, `500us`, `2m` |

use std::time::Duration;

/// Parse a size such as `4096`, `512K`, `256M`, `1G`, `1GiB`, `2T`
/// (binary units).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "{text:?} is not a size (examples: 4096, 512K, 256M, 1G)"
        ));
    }
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?}: number too large"))?;
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use K, M, G or T)"
            ));
        }
    };
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} overflows 64 bits"))
}

/// The longest duration any setting accepts (a day); each setting may
/// bound it further.
pub const DURATION_MAX: Duration = Duration::from_secs(24 * 3600);

/// Parse a duration such as `20ms`, `1.5s`, `500us`, `2m`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (examples: 20ms, 1.5s, 500us)"))?;
    let secs = match unit.trim() {
        "ns" => n / 1e9,
        "us" | "µs" => n / 1e6,
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (use ns, us, ms, s, m or h)"
            ));
        }
    };
    if !secs.is_finite() || !(0.0..=DURATION_MAX.as_secs_f64()).contains(&secs) {
        return Err(format!("{text:?} is outside 0..=24h"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_units_in_any_case_and_refuse_the_rest() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("256m"), Ok(256 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("2 TB"), Ok(2 << 40));
        assert!(parse_size("G").unwrap_err().contains("not a size"));
        assert!(parse_size("1X").unwrap_err().contains("unknown unit"));
        assert!(
            parse_size("99999999999T")
                .unwrap_err()
                .contains("overflows")
        );
        assert!(parse_size("-1").is_err());
    }

    #[test]
    fn durations_take_fractions_and_units_and_refuse_the_rest() {
        assert_eq!(parse_duration("20ms"), Ok(Duration::from_millis(20)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("250µs"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("20").unwrap_err().contains("unknown unit"));
        assert!(parse_duration("ms").unwrap_err().contains("not a duration"));
        assert!(
            parse_duration("-1s")
                .unwrap_err()
                .contains("not a duration")
        );
        assert!(parse_duration("25h").unwrap_err().contains("outside"));
    }
}
