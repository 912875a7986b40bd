//! A device pool's layout on the wire (`RegisterPoolRequest.layout`).
//!
//! Both directions are plain field copies: whether a layout fits its pool is
//! [`PoolLayout::validate`]'s question, asked by the server once it knows the buffers' sizes.

use kvtier_core::{LayerLayout, PoolLayout};

use crate::proto;

impl From<&LayerLayout> for proto::LayerLayout {
    fn from(l: &LayerLayout) -> Self {
        proto::LayerLayout {
            k_buffer: l.k_buffer,
            k_offset: l.k_offset,
            v_buffer: l.v_buffer,
            v_offset: l.v_offset,
            slot_stride: l.slot_stride,
            token_stride: l.token_stride,
            head_stride: l.head_stride,
            group: l.group,
        }
    }
}

impl From<&proto::LayerLayout> for LayerLayout {
    fn from(l: &proto::LayerLayout) -> Self {
        LayerLayout {
            k_buffer: l.k_buffer,
            k_offset: l.k_offset,
            v_buffer: l.v_buffer,
            v_offset: l.v_offset,
            slot_stride: l.slot_stride,
            token_stride: l.token_stride,
            head_stride: l.head_stride,
            group: l.group,
        }
    }
}

impl From<&PoolLayout> for proto::PoolLayout {
    fn from(p: &PoolLayout) -> Self {
        proto::PoolLayout {
            layers: p.layers().iter().map(proto::LayerLayout::from).collect(),
        }
    }
}

impl From<&proto::PoolLayout> for PoolLayout {
    fn from(p: &proto::PoolLayout) -> Self {
        PoolLayout::new(p.layers.iter().map(LayerLayout::from).collect())
    }
}

#[cfg(test)]
mod tests {
    use kvtier_core::{Dtype, KvGeometry, LayoutKind};

    use super::*;

    #[test]
    fn every_named_layout_survives_the_wire() {
        let g = KvGeometry::new(4, 2, 64, Dtype::Bf16, 16).unwrap();
        for kind in LayoutKind::ALL {
            let layout = PoolLayout::of_kind(kind, &g, 8, 4096);
            let wire = proto::PoolLayout::from(&layout);
            assert_eq!(wire.layers.len(), 4);
            assert_eq!(PoolLayout::from(&wire), layout, "{kind}");
        }
    }
}
