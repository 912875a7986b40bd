from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_F32: _ClassVar[Dtype]
    DTYPE_F16: _ClassVar[Dtype]
    DTYPE_BF16: _ClassVar[Dtype]
    DTYPE_FP8_E4M3: _ClassVar[Dtype]
    DTYPE_FP8_E5M2: _ClassVar[Dtype]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]
DTYPE_UNSPECIFIED: Dtype
DTYPE_F32: Dtype
DTYPE_F16: Dtype
DTYPE_BF16: Dtype
DTYPE_FP8_E4M3: Dtype
DTYPE_FP8_E5M2: Dtype
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "watch_removals")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    WATCH_REMOVALS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    watch_removals: bool
    def __init__(self, client_name: _Optional[str] = ..., watch_removals: _Optional[bool] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("opened", "heartbeat", "removed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    heartbeat: Heartbeat
    removed: BlocksRemoved
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("keys", "cleared", "lost")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    cleared: bool
    lost: bool
    def __init__(self, keys: _Optional[bytes] = ..., cleared: _Optional[bool] = ..., lost: _Optional[bool] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "geometry", "sidecar_pid")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    SIDECAR_PID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    geometry: KvGeometry
    sidecar_pid: int
    def __init__(self, session_id: _Optional[int] = ..., geometry: _Optional[_Union[KvGeometry, _Mapping]] = ..., sidecar_pid: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("unix_ms",)
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    unix_ms: int
    def __init__(self, unix_ms: _Optional[int] = ...) -> None: ...

class KvGeometry(_message.Message):
    __slots__ = ("layers", "kv_heads", "head_dim", "dtype", "block_tokens")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    kv_heads: int
    head_dim: int
    dtype: Dtype
    block_tokens: int
    def __init__(self, layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., block_tokens: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("session_id", "model_id", "geometry", "num_slots", "tp_rank", "tp_size", "shm_path", "cuda", "process", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    model_id: str
    geometry: KvGeometry
    num_slots: int
    tp_rank: int
    tp_size: int
    shm_path: str
    cuda: CudaPool
    process: ProcessMemory
    layout: PoolLayout
    def __init__(self, session_id: _Optional[int] = ..., model_id: _Optional[str] = ..., geometry: _Optional[_Union[KvGeometry, _Mapping]] = ..., num_slots: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., shm_path: _Optional[str] = ..., cuda: _Optional[_Union[CudaPool, _Mapping]] = ..., process: _Optional[_Union[ProcessMemory, _Mapping]] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ...) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerLayout]
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerLayout, _Mapping]]] = ...) -> None: ...

class LayerLayout(_message.Message):
    __slots__ = ("k_buffer", "k_offset", "v_buffer", "v_offset", "slot_stride", "token_stride", "head_stride", "group")
    K_BUFFER_FIELD_NUMBER: _ClassVar[int]
    K_OFFSET_FIELD_NUMBER: _ClassVar[int]
    V_BUFFER_FIELD_NUMBER: _ClassVar[int]
    V_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRIDE_FIELD_NUMBER: _ClassVar[int]
    HEAD_STRIDE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    k_buffer: int
    k_offset: int
    v_buffer: int
    v_offset: int
    slot_stride: int
    token_stride: int
    head_stride: int
    group: int
    def __init__(self, k_buffer: _Optional[int] = ..., k_offset: _Optional[int] = ..., v_buffer: _Optional[int] = ..., v_offset: _Optional[int] = ..., slot_stride: _Optional[int] = ..., token_stride: _Optional[int] = ..., head_stride: _Optional[int] = ..., group: _Optional[int] = ...) -> None: ...

class ProcessMemory(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[ProcessBuffer]
    def __init__(self, buffers: _Optional[_Iterable[_Union[ProcessBuffer, _Mapping]]] = ...) -> None: ...

class ProcessBuffer(_message.Message):
    __slots__ = ("address", "size_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: int
    size_bytes: int
    def __init__(self, address: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class CudaPool(_message.Message):
    __slots__ = ("device_ordinal", "device_uuid", "buffers")
    DEVICE_ORDINAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    device_ordinal: int
    device_uuid: bytes
    buffers: _containers.RepeatedCompositeFieldContainer[CudaBuffer]
    def __init__(self, device_ordinal: _Optional[int] = ..., device_uuid: _Optional[bytes] = ..., buffers: _Optional[_Iterable[_Union[CudaBuffer, _Mapping]]] = ...) -> None: ...

class CudaBuffer(_message.Message):
    __slots__ = ("ipc_handle", "offset_bytes", "size_bytes")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    offset_bytes: int
    size_bytes: int
    def __init__(self, ipc_handle: _Optional[bytes] = ..., offset_bytes: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "namespace_fingerprint")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    namespace_fingerprint: bytes
    def __init__(self, pool_id: _Optional[int] = ..., namespace_fingerprint: _Optional[bytes] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("session_id", "pool_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pool_id: int
    def __init__(self, session_id: _Optional[int] = ..., pool_id: _Optional[int] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "cache_salt", "keys", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pool_id: int
    cache_salt: str
    keys: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[int] = ..., pool_id: _Optional[int] = ..., cache_salt: _Optional[str] = ..., keys: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("tiers", "device_slots", "keys", "matched_tokens", "device_tokens", "host_tokens", "disk_tokens", "remote_tokens")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    device_slots: _containers.RepeatedScalarFieldContainer[int]
    keys: bytes
    matched_tokens: int
    device_tokens: int
    host_tokens: int
    disk_tokens: int
    remote_tokens: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., device_slots: _Optional[_Iterable[int]] = ..., keys: _Optional[bytes] = ..., matched_tokens: _Optional[int] = ..., device_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., disk_tokens: _Optional[int] = ..., remote_tokens: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "cache_salt", "keys", "slots", "deadline_ms", "layer_event_stride", "done_only", "group_slots")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LAYER_EVENT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    DONE_ONLY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pool_id: int
    cache_salt: str
    keys: bytes
    slots: _containers.RepeatedScalarFieldContainer[int]
    deadline_ms: int
    layer_event_stride: int
    done_only: bool
    group_slots: _containers.RepeatedCompositeFieldContainer[GroupSlots]
    def __init__(self, session_id: _Optional[int] = ..., pool_id: _Optional[int] = ..., cache_salt: _Optional[str] = ..., keys: _Optional[bytes] = ..., slots: _Optional[_Iterable[int]] = ..., deadline_ms: _Optional[int] = ..., layer_event_stride: _Optional[int] = ..., done_only: _Optional[bool] = ..., group_slots: _Optional[_Iterable[_Union[GroupSlots, _Mapping]]] = ...) -> None: ...

class GroupSlots(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class LoadEvent(_message.Message):
    __slots__ = ("layer_ready", "missing", "done")
    LAYER_READY_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    layer_ready: LayerReady
    missing: BlocksMissing
    done: LoadDone
    def __init__(self, layer_ready: _Optional[_Union[LayerReady, _Mapping]] = ..., missing: _Optional[_Union[BlocksMissing, _Mapping]] = ..., done: _Optional[_Union[LoadDone, _Mapping]] = ...) -> None: ...

class LayerReady(_message.Message):
    __slots__ = ("layer",)
    LAYER_FIELD_NUMBER: _ClassVar[int]
    layer: int
    def __init__(self, layer: _Optional[int] = ...) -> None: ...

class BlocksMissing(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: bytes
    def __init__(self, keys: _Optional[bytes] = ...) -> None: ...

class TransferTiming(_message.Message):
    __slots__ = ("queue_us", "latency_us", "span_us", "active_us")
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    LATENCY_US_FIELD_NUMBER: _ClassVar[int]
    SPAN_US_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_US_FIELD_NUMBER: _ClassVar[int]
    queue_us: int
    latency_us: int
    span_us: int
    active_us: int
    def __init__(self, queue_us: _Optional[int] = ..., latency_us: _Optional[int] = ..., span_us: _Optional[int] = ..., active_us: _Optional[int] = ...) -> None: ...

class LoadDone(_message.Message):
    __slots__ = ("loaded_blocks", "disk_blocks", "missing", "bytes", "timing", "remote_blocks")
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    loaded_blocks: int
    disk_blocks: int
    missing: bytes
    bytes: int
    timing: TransferTiming
    remote_blocks: int
    def __init__(self, loaded_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., missing: _Optional[bytes] = ..., bytes: _Optional[int] = ..., timing: _Optional[_Union[TransferTiming, _Mapping]] = ..., remote_blocks: _Optional[int] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "cache_salt", "keys", "slots", "parent", "durable", "group_slots", "not_after_unix_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pool_id: int
    cache_salt: str
    keys: bytes
    slots: _containers.RepeatedScalarFieldContainer[int]
    parent: bytes
    durable: bool
    group_slots: _containers.RepeatedCompositeFieldContainer[GroupSlots]
    not_after_unix_ms: int
    def __init__(self, session_id: _Optional[int] = ..., pool_id: _Optional[int] = ..., cache_salt: _Optional[str] = ..., keys: _Optional[bytes] = ..., slots: _Optional[_Iterable[int]] = ..., parent: _Optional[bytes] = ..., durable: _Optional[bool] = ..., group_slots: _Optional[_Iterable[_Union[GroupSlots, _Mapping]]] = ..., not_after_unix_ms: _Optional[int] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("stored_blocks", "already_stored", "no_space", "bytes", "timing", "durable_blocks", "not_durable")
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    NO_SPACE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    DURABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NOT_DURABLE_FIELD_NUMBER: _ClassVar[int]
    stored_blocks: int
    already_stored: int
    no_space: bytes
    bytes: int
    timing: TransferTiming
    durable_blocks: int
    not_durable: bytes
    def __init__(self, stored_blocks: _Optional[int] = ..., already_stored: _Optional[int] = ..., no_space: _Optional[bytes] = ..., bytes: _Optional[int] = ..., timing: _Optional[_Union[TransferTiming, _Mapping]] = ..., durable_blocks: _Optional[int] = ..., not_durable: _Optional[bytes] = ...) -> None: ...

class DeviceEvent(_message.Message):
    __slots__ = ("kind", "key", "slot")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[DeviceEvent.Kind]
        KIND_STORED: _ClassVar[DeviceEvent.Kind]
        KIND_REMOVED: _ClassVar[DeviceEvent.Kind]
        KIND_CLEARED: _ClassVar[DeviceEvent.Kind]
    KIND_UNSPECIFIED: DeviceEvent.Kind
    KIND_STORED: DeviceEvent.Kind
    KIND_REMOVED: DeviceEvent.Kind
    KIND_CLEARED: DeviceEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    kind: DeviceEvent.Kind
    key: bytes
    slot: int
    def __init__(self, kind: _Optional[_Union[DeviceEvent.Kind, str]] = ..., key: _Optional[bytes] = ..., slot: _Optional[int] = ...) -> None: ...

class DeviceEventsRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "events")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pool_id: int
    events: _containers.RepeatedCompositeFieldContainer[DeviceEvent]
    def __init__(self, session_id: _Optional[int] = ..., pool_id: _Optional[int] = ..., events: _Optional[_Iterable[_Union[DeviceEvent, _Mapping]]] = ...) -> None: ...

class DeviceEventsResponse(_message.Message):
    __slots__ = ("applied", "device_blocks")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    applied: int
    device_blocks: int
    def __init__(self, applied: _Optional[int] = ..., device_blocks: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "cache_salt", "keys", "ttl_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pool_id: int
    cache_salt: str
    keys: bytes
    ttl_ms: int
    def __init__(self, session_id: _Optional[int] = ..., pool_id: _Optional[int] = ..., cache_salt: _Optional[str] = ..., keys: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("pin_id", "pinned_blocks", "missing")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    pin_id: int
    pinned_blocks: int
    missing: bytes
    def __init__(self, pin_id: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., missing: _Optional[bytes] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("session_id", "pin_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pin_id: int
    def __init__(self, session_id: _Optional[int] = ..., pin_id: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("released_blocks",)
    RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    released_blocks: int
    def __init__(self, released_blocks: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("session_id", "pool_id", "cache_salt", "all", "tier")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    pool_id: int
    cache_salt: str
    all: bool
    tier: Tier
    def __init__(self, session_id: _Optional[int] = ..., pool_id: _Optional[int] = ..., cache_salt: _Optional[str] = ..., all: _Optional[bool] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("host_blocks", "disk_blocks", "kept_pinned", "remote_blocks")
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEPT_PINNED_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    host_blocks: int
    disk_blocks: int
    kept_pinned: int
    remote_blocks: int
    def __init__(self, host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ..., kept_pinned: _Optional[int] = ..., remote_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("json", "sessions", "pools", "pinned_blocks", "host_used_bytes", "host_capacity_bytes", "disk_used_bytes", "disk_capacity_bytes")
    JSON_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    json: str
    sessions: int
    pools: int
    pinned_blocks: int
    host_used_bytes: int
    host_capacity_bytes: int
    disk_used_bytes: int
    disk_capacity_bytes: int
    def __init__(self, json: _Optional[str] = ..., sessions: _Optional[int] = ..., pools: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., host_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ...) -> None: ...
