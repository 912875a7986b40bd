//! Human byte sizes for flags and configuration files.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::CoreError;

/// A size in bytes, parsed from text such as `4096`, `512MiB`, `2GiB`, `1.5G` or `10GB`.
///
/// Binary units (`K`, `KiB`, `M`, `MiB`, `G`, `GiB`, `T`, `TiB`) are powers of 1024; decimal
/// units (`KB`, `MB`, `GB`, `TB`) are powers of 1000. Serialized as the text form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// `n` KiB.
    pub const fn kib(n: u64) -> Self {
        ByteSize(n << 10)
    }
    /// `n` MiB.
    pub const fn mib(n: u64) -> Self {
        ByteSize(n << 20)
    }
    /// `n` GiB.
    pub const fn gib(n: u64) -> Self {
        ByteSize(n << 30)
    }
    /// The number of bytes.
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = CoreError;
    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let err = |reason| CoreError::InvalidByteSize {
            input: input.to_owned(),
            reason,
        };
        let s = input.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        if num.is_empty() {
            return Err(err("expected a number followed by an optional unit"));
        }
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            _ => return Err(err("unknown unit (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")),
        };
        if let Ok(n) = num.parse::<u64>() {
            return n.checked_mul(mult).map(ByteSize).ok_or(err("too large"));
        }
        let f: f64 = num.parse().map_err(|_| err("not a number"))?;
        let bytes = f * mult as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(err("too large"));
        }
        Ok(ByteSize(bytes.round() as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
            if b >= 1 << shift {
                return if b.is_multiple_of(1 << shift) {
                    write!(f, "{}{unit}", b >> shift)
                } else {
                    write!(f, "{:.2}{unit}", b as f64 / (1u64 << shift) as f64)
                };
            }
        }
        write!(f, "{b}B")
    }
}

impl Serialize for ByteSize {
    /// Exactly: `8GiB` when the size is a whole number of a binary unit, else the byte count
    /// (so a printed configuration reads back the same).
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let b = self.0;
        for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
            if b >= 1 << shift && b.is_multiple_of(1 << shift) {
                return s.serialize_str(&format!("{}{unit}", b >> shift));
            }
        }
        s.serialize_u64(b)
    }
}

/// What a size may be written as, for error messages.
pub const BYTE_SIZE_FORM: &str = "a size such as 8GiB, 512MiB, 1.5GB or a byte count";

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl serde::de::Visitor<'_> for Visit {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(BYTE_SIZE_FORM)
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(n))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteSize, E> {
                u64::try_from(n)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a size cannot be negative ({n}); give {BYTE_SIZE_FORM}")))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<ByteSize, E> {
                Err(E::custom(format!(
                    "{n} is not a whole number of bytes; give {BYTE_SIZE_FORM}"
                )))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
                s.parse()
                    .map_err(|e| E::custom(format!("{e}; give {BYTE_SIZE_FORM}")))
            }
        }
        d.deserialize_any(Visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        for (s, v) in [
            ("4096", 4096),
            ("512MiB", 512 << 20),
            ("2GiB", 2 << 30),
            ("2g", 2 << 30),
            ("1.5GiB", 3 << 29),
            ("10GB", 10_000_000_000),
            (" 64 KiB ", 64 << 10),
        ] {
            assert_eq!(s.parse::<ByteSize>().unwrap(), ByteSize(v), "{s}");
        }
    }

    #[test]
    fn refuses_garbage() {
        for s in ["", "GiB", "12XB", "-1", "1.2.3G", "99999999999999999999TiB"] {
            assert!(
                matches!(s.parse::<ByteSize>(), Err(CoreError::InvalidByteSize { .. })),
                "{s}"
            );
        }
    }

    #[test]
    fn displays_round_trip() {
        for v in [0u64, 1023, 1 << 20, 3 << 29, 5 << 40] {
            let b = ByteSize(v);
            let back: ByteSize = b.to_string().parse().unwrap();
            assert!((back.0 as i128 - v as i128).abs() <= (v as i128) / 100, "{b}");
        }
        assert_eq!(ByteSize::gib(2).to_string(), "2GiB");
    }

    #[test]
    fn serde_is_exact_and_names_the_form() {
        for v in [0u64, 1023, 1 << 20, 3 << 29, 1_000_000_000, 5 << 40] {
            let json = serde_json::to_string(&ByteSize(v)).unwrap();
            assert_eq!(
                serde_json::from_str::<ByteSize>(&json).unwrap(),
                ByteSize(v),
                "{json}"
            );
        }
        assert_eq!(serde_json::to_string(&ByteSize::gib(8)).unwrap(), "\"8GiB\"");
        for bad in ["-1", "1.5", "\"lots\"", "true"] {
            let e = serde_json::from_str::<ByteSize>(bad).unwrap_err().to_string();
            assert!(e.contains("8GiB"), "{bad}: {e}");
        }
        let e = serde_json::from_str::<ByteSize>("-1").unwrap_err().to_string();
        assert!(e.contains("negative"), "{e}");
    }
}
