//! KV geometry and dtype on the wire.

use kvtier_core::{Dtype, KvGeometry};

use crate::ProtoError;
use crate::proto;

impl From<Dtype> for proto::Dtype {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => proto::Dtype::F32,
            Dtype::F16 => proto::Dtype::F16,
            Dtype::Bf16 => proto::Dtype::Bf16,
            Dtype::Fp8E4m3 => proto::Dtype::Fp8E4m3,
            Dtype::Fp8E5m2 => proto::Dtype::Fp8E5m2,
            // A dtype kvtier-core gained before the proto did: the peer refuses it as unknown.
            _ => proto::Dtype::Unspecified,
        }
    }
}

impl TryFrom<proto::Dtype> for Dtype {
    type Error = ProtoError;

    /// # Errors
    /// [`ProtoError::UnknownEnum`] for `DTYPE_UNSPECIFIED` (field `dtype`).
    fn try_from(d: proto::Dtype) -> Result<Self, ProtoError> {
        dtype_from_proto("dtype", d as i32)
    }
}

/// The dtype of the wire value `value` of `field`.
fn dtype_from_proto(field: &'static str, value: i32) -> Result<Dtype, ProtoError> {
    match proto::Dtype::try_from(value) {
        Ok(proto::Dtype::F32) => Ok(Dtype::F32),
        Ok(proto::Dtype::F16) => Ok(Dtype::F16),
        Ok(proto::Dtype::Bf16) => Ok(Dtype::Bf16),
        Ok(proto::Dtype::Fp8E4m3) => Ok(Dtype::Fp8E4m3),
        Ok(proto::Dtype::Fp8E5m2) => Ok(Dtype::Fp8E5m2),
        Ok(proto::Dtype::Unspecified) | Err(_) => Err(ProtoError::UnknownEnum {
            field,
            kind: "dtype",
            value,
        }),
    }
}

impl From<&KvGeometry> for proto::KvGeometry {
    fn from(g: &KvGeometry) -> Self {
        proto::KvGeometry {
            layers: g.layers(),
            kv_heads: g.kv_heads(),
            head_dim: g.head_dim(),
            dtype: proto::Dtype::from(g.dtype()) as i32,
            block_tokens: g.block_tokens(),
        }
    }
}

impl From<KvGeometry> for proto::KvGeometry {
    fn from(g: KvGeometry) -> Self {
        Self::from(&g)
    }
}

impl TryFrom<&proto::KvGeometry> for KvGeometry {
    type Error = ProtoError;

    /// Validates like [`KvGeometry::new`]; errors name the field as `geometry` (the name it has
    /// in every kvtier.v1 message that carries one).
    ///
    /// # Errors
    /// [`ProtoError::UnknownEnum`] for `geometry.dtype`, [`ProtoError::Geometry`] for a field
    /// kvtier-core refuses.
    fn try_from(g: &proto::KvGeometry) -> Result<Self, ProtoError> {
        geometry_of(g)
    }
}

impl TryFrom<proto::KvGeometry> for KvGeometry {
    type Error = ProtoError;

    /// As for `&proto::KvGeometry`.
    fn try_from(g: proto::KvGeometry) -> Result<Self, ProtoError> {
        Self::try_from(&g)
    }
}

/// The geometry in the message field `geometry` (`RegisterPoolRequest.geometry`,
/// `SessionOpened.geometry`), which is required.
///
/// # Errors
/// [`ProtoError::Missing`] when absent, else as `KvGeometry::try_from`.
pub fn geometry_from_proto(geometry: Option<&proto::KvGeometry>) -> Result<KvGeometry, ProtoError> {
    geometry_of(geometry.ok_or(ProtoError::Missing { field: "geometry" })?)
}

fn geometry_of(g: &proto::KvGeometry) -> Result<KvGeometry, ProtoError> {
    let dtype = dtype_from_proto("geometry.dtype", g.dtype)?;
    KvGeometry::new(g.layers, g.kv_heads, g.head_dim, dtype, g.block_tokens).map_err(|source| {
        ProtoError::Geometry {
            field: "geometry",
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use kvtier_core::CoreError;

    use super::*;

    const DTYPES: [Dtype; 5] = [
        Dtype::F32,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::Fp8E4m3,
        Dtype::Fp8E5m2,
    ];

    #[test]
    fn dtypes_round_trip_and_keep_their_codes() {
        for d in DTYPES {
            let p = proto::Dtype::from(d);
            assert_eq!(Dtype::try_from(p).unwrap(), d);
            // The wire values are the binary-header codes, so both stay stable together.
            assert_eq!(p as i32 as u32, d.code(), "{d}");
        }
        assert_eq!(
            Dtype::try_from(proto::Dtype::Unspecified).unwrap_err(),
            ProtoError::UnknownEnum {
                field: "dtype",
                kind: "dtype",
                value: 0
            }
        );
    }

    #[test]
    fn geometries_round_trip() {
        for d in DTYPES {
            let g = KvGeometry::new(48, 4, 128, d, 64).unwrap();
            let p = proto::KvGeometry::from(&g);
            assert_eq!(p.layers, 48);
            assert_eq!(p.block_tokens, 64);
            assert_eq!(KvGeometry::try_from(&p).unwrap(), g);
            assert_eq!(KvGeometry::try_from(p).unwrap(), g);
            assert_eq!(geometry_from_proto(Some(&p)).unwrap(), g);
            assert_eq!(proto::KvGeometry::from(g), p);
        }
    }

    #[test]
    fn unknown_dtype_names_the_field_and_value() {
        let mut p = proto::KvGeometry::from(KvGeometry::new(2, 1, 8, Dtype::Bf16, 16).unwrap());
        p.dtype = 9;
        let e = KvGeometry::try_from(&p).unwrap_err();
        assert_eq!(e.to_string(), "geometry.dtype: unknown dtype 9");
        p.dtype = proto::Dtype::Unspecified as i32;
        assert_eq!(
            geometry_from_proto(Some(&p)).unwrap_err().to_string(),
            "geometry.dtype: unknown dtype 0"
        );
    }

    #[test]
    fn missing_and_invalid_geometries_are_refused() {
        assert_eq!(
            geometry_from_proto(None).unwrap_err(),
            ProtoError::Missing { field: "geometry" }
        );
        assert_eq!(
            geometry_from_proto(None).unwrap_err().to_string(),
            "geometry is required"
        );
        let mut p = proto::KvGeometry::from(KvGeometry::new(2, 1, 8, Dtype::F16, 16).unwrap());
        p.layers = 0;
        let e = KvGeometry::try_from(&p).unwrap_err();
        assert!(
            matches!(
                &e,
                ProtoError::Geometry {
                    field: "geometry",
                    source: CoreError::InvalidGeometry { field: "layers", .. }
                }
            ),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .starts_with("geometry: invalid KV geometry: layers=0"),
            "{e}"
        );
    }
}
