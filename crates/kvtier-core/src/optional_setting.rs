//! Optional settings in TOML, which has no null: `"off"` is "not set", both when read and when
//! printed, so `--print-config` shows every key and reads back the same.
//!
//! Used as `#[serde(with = "kvtier_core::optional_setting")]` on `Option<T>` fields whose `T` is
//! written as a string (an address, a path) or as a table (the `[disk]` section). The value is
//! handed to `T` as it came, so errors inside it keep their key path and file position.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, IntoDeserializer, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The word for "not set".
pub const OFF: &str = "off";

/// Prints `None` as `"off"`.
///
/// # Errors
/// The serializer's.
pub fn serialize<T: Serialize, S: Serializer>(value: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) => v.serialize(s),
        None => s.serialize_str(OFF),
    }
}

/// Reads `"off"` as `None`, anything else as `T`.
///
/// # Errors
/// `T`'s, for a value that is neither.
pub fn deserialize<'de, T: Deserialize<'de>, D: Deserializer<'de>>(d: D) -> Result<Option<T>, D::Error> {
    struct Visit<T>(PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for Visit<T> {
        type Value = Option<T>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "a value or \"{OFF}\"")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Option<T>, E> {
            if s == OFF {
                return Ok(None);
            }
            T::deserialize(s.into_deserializer()).map(Some)
        }
        fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Option<T>, A::Error> {
            T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Some)
        }
        fn visit_i64<E: de::Error>(self, n: i64) -> Result<Option<T>, E> {
            T::deserialize(n.into_deserializer()).map(Some)
        }
        fn visit_u64<E: de::Error>(self, n: u64) -> Result<Option<T>, E> {
            T::deserialize(n.into_deserializer()).map(Some)
        }
        fn visit_bool<E: de::Error>(self, b: bool) -> Result<Option<T>, E> {
            T::deserialize(b.into_deserializer()).map(Some)
        }
    }
    d.deserialize_any(Visit(PhantomData))
}
