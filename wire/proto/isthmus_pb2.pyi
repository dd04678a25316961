from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "codec", "offset", "nbytes", "codec_meta", "global_shape", "box_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CODEC_META_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    BOX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    codec: str
    offset: int
    nbytes: int
    codec_meta: bytes
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    box_offset: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., codec: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., codec_meta: _Optional[bytes] = ..., global_shape: _Optional[_Iterable[int]] = ..., box_offset: _Optional[_Iterable[int]] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("tensors", "total_bytes", "digest", "parts")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    total_bytes: int
    digest: bytes
    parts: _containers.RepeatedCompositeFieldContainer[PayloadPart]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., digest: _Optional[bytes] = ..., parts: _Optional[_Iterable[_Union[PayloadPart, _Mapping]]] = ...) -> None: ...

class PayloadPart(_message.Message):
    __slots__ = ("offset", "length", "digest")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    digest: bytes
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., digest: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("site", "lease_id", "token", "ttl_s")
    SITE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    site: str
    lease_id: int
    token: int
    ttl_s: float
    def __init__(self, site: _Optional[str] = ..., lease_id: _Optional[int] = ..., token: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("codecs", "world_size", "num_examples")
    CODECS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    codecs: _containers.RepeatedScalarFieldContainer[str]
    world_size: int
    num_examples: int
    def __init__(self, codecs: _Optional[_Iterable[str]] = ..., world_size: _Optional[int] = ..., num_examples: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("site", "capabilities", "have_version", "have_hash")
    SITE_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAVE_HASH_FIELD_NUMBER: _ClassVar[int]
    site: str
    capabilities: Capabilities
    have_version: int
    have_hash: bytes
    def __init__(self, site: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., have_version: _Optional[int] = ..., have_hash: _Optional[bytes] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "version", "theta_hash", "inner_steps", "total_rounds", "finished", "participant", "data_unit", "update_wanted", "site_index", "num_sites", "fragment")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    THETA_HASH_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_FIELD_NUMBER: _ClassVar[int]
    DATA_UNIT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_WANTED_FIELD_NUMBER: _ClassVar[int]
    SITE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SITES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    round: int
    version: int
    theta_hash: bytes
    inner_steps: int
    total_rounds: int
    finished: bool
    participant: bool
    data_unit: str
    update_wanted: bool
    site_index: int
    num_sites: int
    fragment: int
    def __init__(self, round: _Optional[int] = ..., version: _Optional[int] = ..., theta_hash: _Optional[bytes] = ..., inner_steps: _Optional[int] = ..., total_rounds: _Optional[int] = ..., finished: _Optional[bool] = ..., participant: _Optional[bool] = ..., data_unit: _Optional[str] = ..., update_wanted: _Optional[bool] = ..., site_index: _Optional[int] = ..., num_sites: _Optional[int] = ..., fragment: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("lease", "round", "job_name", "job_config", "heartbeat_interval_s", "shards")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    JOB_CONFIG_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    round: RoundInfo
    job_name: str
    job_config: bytes
    heartbeat_interval_s: float
    shards: ShardMap
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ..., job_name: _Optional[str] = ..., job_config: _Optional[bytes] = ..., heartbeat_interval_s: _Optional[float] = ..., shards: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class ShardMap(_message.Message):
    __slots__ = ("addresses", "owner", "plan_digest")
    class OwnerEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    owner: _containers.ScalarMap[str, int]
    plan_digest: str
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., owner: _Optional[_Mapping[str, int]] = ..., plan_digest: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("round", "inner_step", "train_loss", "phase", "merge_wait_s", "fetch_bytes_per_s", "task_compute_s", "steps_per_s", "compute_utilisation", "fetch_latency_s")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MERGE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FETCH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TASK_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILISATION_FIELD_NUMBER: _ClassVar[int]
    FETCH_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    round: int
    inner_step: int
    train_loss: float
    phase: str
    merge_wait_s: float
    fetch_bytes_per_s: float
    task_compute_s: float
    steps_per_s: float
    compute_utilisation: float
    fetch_latency_s: float
    def __init__(self, round: _Optional[int] = ..., inner_step: _Optional[int] = ..., train_loss: _Optional[float] = ..., phase: _Optional[str] = ..., merge_wait_s: _Optional[float] = ..., fetch_bytes_per_s: _Optional[float] = ..., task_compute_s: _Optional[float] = ..., steps_per_s: _Optional[float] = ..., compute_utilisation: _Optional[float] = ..., fetch_latency_s: _Optional[float] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("new_round", "cancel_unit", "drain")
    NEW_ROUND_FIELD_NUMBER: _ClassVar[int]
    CANCEL_UNIT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    new_round: RoundInfo
    cancel_unit: str
    drain: str
    def __init__(self, new_round: _Optional[_Union[RoundInfo, _Mapping]] = ..., cancel_unit: _Optional[str] = ..., drain: _Optional[str] = ...) -> None: ...

class HealthReport(_message.Message):
    __slots__ = ("round", "matmul_gflops", "allreduce_gbps", "world_size", "device", "gpu_errors", "seq")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MATMUL_GFLOPS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_GBPS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    round: int
    matmul_gflops: float
    allreduce_gbps: float
    world_size: int
    device: str
    gpu_errors: _containers.RepeatedScalarFieldContainer[str]
    seq: int
    def __init__(self, round: _Optional[int] = ..., matmul_gflops: _Optional[float] = ..., allreduce_gbps: _Optional[float] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., gpu_errors: _Optional[_Iterable[str]] = ..., seq: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("lease", "progress", "health")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    progress: Progress
    health: HealthReport
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., health: _Optional[_Union[HealthReport, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("lease", "round", "commands")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    round: RoundInfo
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ..., commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ...) -> None: ...

class WaitRoundRequest(_message.Message):
    __slots__ = ("lease", "known", "timeout_s")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    known: RoundInfo
    timeout_s: float
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., known: _Optional[_Union[RoundInfo, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class WaitRoundReply(_message.Message):
    __slots__ = ("round", "commands")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    round: RoundInfo
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    def __init__(self, round: _Optional[_Union[RoundInfo, _Mapping]] = ..., commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("lease", "version", "from_version", "offset", "length", "block_digests", "shard_pass")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_PASS_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    version: int
    from_version: int
    offset: int
    length: int
    block_digests: bool
    shard_pass: bytes
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., version: _Optional[int] = ..., from_version: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., block_digests: _Optional[bool] = ..., shard_pass: _Optional[bytes] = ...) -> None: ...

class FetchHeader(_message.Message):
    __slots__ = ("version", "from_version", "theta_hash", "manifest", "block_bytes", "block_digests", "shard_pass")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    THETA_HASH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_PASS_FIELD_NUMBER: _ClassVar[int]
    version: int
    from_version: int
    theta_hash: bytes
    manifest: Manifest
    block_bytes: int
    block_digests: _containers.RepeatedScalarFieldContainer[bytes]
    shard_pass: bytes
    def __init__(self, version: _Optional[int] = ..., from_version: _Optional[int] = ..., theta_hash: _Optional[bytes] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., block_bytes: _Optional[int] = ..., block_digests: _Optional[_Iterable[bytes]] = ..., shard_pass: _Optional[bytes] = ...) -> None: ...

class FetchMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: FetchHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[FetchHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class ByteRange(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("lease", "round", "upload_id", "data_unit", "manifest", "weight", "base_version", "reserve", "piece", "keep_open", "shard_digests", "shard_receipts", "shard_pass")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_UNIT_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESERVE_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    KEEP_OPEN_FIELD_NUMBER: _ClassVar[int]
    SHARD_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_PASS_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    round: int
    upload_id: str
    data_unit: str
    manifest: Manifest
    weight: float
    base_version: int
    reserve: bool
    piece: ByteRange
    keep_open: bool
    shard_digests: _containers.RepeatedScalarFieldContainer[bytes]
    shard_receipts: _containers.RepeatedScalarFieldContainer[bytes]
    shard_pass: bytes
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., round: _Optional[int] = ..., upload_id: _Optional[str] = ..., data_unit: _Optional[str] = ..., manifest: _Optional[_Union[Manifest, _Mapping]] = ..., weight: _Optional[float] = ..., base_version: _Optional[int] = ..., reserve: _Optional[bool] = ..., piece: _Optional[_Union[ByteRange, _Mapping]] = ..., keep_open: _Optional[bool] = ..., shard_digests: _Optional[_Iterable[bytes]] = ..., shard_receipts: _Optional[_Iterable[bytes]] = ..., shard_pass: _Optional[bytes] = ...) -> None: ...

class PushMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("complete", "acked_offset", "message", "granted", "received", "receipt")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ACKED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    acked_offset: int
    message: str
    granted: bool
    received: _containers.RepeatedCompositeFieldContainer[ByteRange]
    receipt: bytes
    def __init__(self, complete: _Optional[bool] = ..., acked_offset: _Optional[int] = ..., message: _Optional[str] = ..., granted: _Optional[bool] = ..., received: _Optional[_Iterable[_Union[ByteRange, _Mapping]]] = ..., receipt: _Optional[bytes] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("lease", "reason")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    reason: str
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SiteStatus(_message.Message):
    __slots__ = ("site", "state", "token", "lease_remaining_s", "last_heartbeat_age_s", "last_update_age_s", "last_round_pushed", "progress", "phi", "suspected", "data_units", "drained", "health", "updates_counted", "late_updates", "stale_versions")
    SITE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_PUSHED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    PHI_FIELD_NUMBER: _ClassVar[int]
    SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    DATA_UNITS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    UPDATES_COUNTED_FIELD_NUMBER: _ClassVar[int]
    LATE_UPDATES_FIELD_NUMBER: _ClassVar[int]
    STALE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    site: str
    state: str
    token: int
    lease_remaining_s: float
    last_heartbeat_age_s: float
    last_update_age_s: float
    last_round_pushed: int
    progress: Progress
    phi: float
    suspected: bool
    data_units: _containers.RepeatedScalarFieldContainer[str]
    drained: str
    health: HealthReport
    updates_counted: int
    late_updates: int
    stale_versions: int
    def __init__(self, site: _Optional[str] = ..., state: _Optional[str] = ..., token: _Optional[int] = ..., lease_remaining_s: _Optional[float] = ..., last_heartbeat_age_s: _Optional[float] = ..., last_update_age_s: _Optional[float] = ..., last_round_pushed: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., phi: _Optional[float] = ..., suspected: _Optional[bool] = ..., data_units: _Optional[_Iterable[str]] = ..., drained: _Optional[str] = ..., health: _Optional[_Union[HealthReport, _Mapping]] = ..., updates_counted: _Optional[int] = ..., late_updates: _Optional[int] = ..., stale_versions: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("job_name", "round", "sites", "updates_received", "updates_expected", "round_age_s", "waiting_reason", "strategy", "wan_bytes_in", "wan_bytes_out", "rejections", "aggregation", "data_mode", "units_committed", "units_pending", "evaluation", "fragments", "shards")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_AGE_S_FIELD_NUMBER: _ClassVar[int]
    WAITING_REASON_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    WAN_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    WAN_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    DATA_MODE_FIELD_NUMBER: _ClassVar[int]
    UNITS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    UNITS_PENDING_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    round: RoundInfo
    sites: _containers.RepeatedCompositeFieldContainer[SiteStatus]
    updates_received: int
    updates_expected: int
    round_age_s: float
    waiting_reason: str
    strategy: str
    wan_bytes_in: int
    wan_bytes_out: int
    rejections: _containers.RepeatedScalarFieldContainer[str]
    aggregation: str
    data_mode: str
    units_committed: _containers.RepeatedScalarFieldContainer[str]
    units_pending: _containers.RepeatedScalarFieldContainer[str]
    evaluation: Evaluation
    fragments: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardState]
    def __init__(self, job_name: _Optional[str] = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ..., sites: _Optional[_Iterable[_Union[SiteStatus, _Mapping]]] = ..., updates_received: _Optional[int] = ..., updates_expected: _Optional[int] = ..., round_age_s: _Optional[float] = ..., waiting_reason: _Optional[str] = ..., strategy: _Optional[str] = ..., wan_bytes_in: _Optional[int] = ..., wan_bytes_out: _Optional[int] = ..., rejections: _Optional[_Iterable[str]] = ..., aggregation: _Optional[str] = ..., data_mode: _Optional[str] = ..., units_committed: _Optional[_Iterable[str]] = ..., units_pending: _Optional[_Iterable[str]] = ..., evaluation: _Optional[_Union[Evaluation, _Mapping]] = ..., fragments: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardState, _Mapping]]] = ...) -> None: ...

class ShardState(_message.Message):
    __slots__ = ("shard", "address", "version", "parts_held", "bytes", "problem")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTS_HELD_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    shard: int
    address: str
    version: int
    parts_held: int
    bytes: int
    problem: str
    def __init__(self, shard: _Optional[int] = ..., address: _Optional[str] = ..., version: _Optional[int] = ..., parts_held: _Optional[int] = ..., bytes: _Optional[int] = ..., problem: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("site", "undrain", "reason")
    SITE_FIELD_NUMBER: _ClassVar[int]
    UNDRAIN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    site: str
    undrain: bool
    reason: str
    def __init__(self, site: _Optional[str] = ..., undrain: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("changed", "message", "drained")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    message: str
    drained: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, changed: _Optional[bool] = ..., message: _Optional[str] = ..., drained: _Optional[_Iterable[str]] = ...) -> None: ...

class Evaluation(_message.Message):
    __slots__ = ("version", "metrics", "seconds")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    metrics: _containers.ScalarMap[str, float]
    seconds: float
    def __init__(self, version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., seconds: _Optional[float] = ...) -> None: ...

class ShardPart(_message.Message):
    __slots__ = ("site", "upload_id", "digest", "weight", "alpha")
    SITE_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    site: str
    upload_id: str
    digest: bytes
    weight: float
    alpha: float
    def __init__(self, site: _Optional[str] = ..., upload_id: _Optional[str] = ..., digest: _Optional[bytes] = ..., weight: _Optional[float] = ..., alpha: _Optional[float] = ...) -> None: ...

class ShardCloseRequest(_message.Message):
    __slots__ = ("round", "parts", "plan_digest", "epoch")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    round: int
    parts: _containers.RepeatedCompositeFieldContainer[ShardPart]
    plan_digest: str
    epoch: int
    def __init__(self, round: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[ShardPart, _Mapping]]] = ..., plan_digest: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ShardAlignRequest(_message.Message):
    __slots__ = ("version", "epoch", "plan_digest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    plan_digest: str
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ..., plan_digest: _Optional[str] = ...) -> None: ...

class TensorDigest(_message.Message):
    __slots__ = ("name", "dtype", "shape", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    digest: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., digest: _Optional[bytes] = ...) -> None: ...

class ShardCloseReply(_message.Message):
    __slots__ = ("version", "tensors", "replayed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorDigest]
    replayed: bool
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorDigest, _Mapping]]] = ..., replayed: _Optional[bool] = ...) -> None: ...

class ShardStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardStatusReply(_message.Message):
    __slots__ = ("shard", "shards", "plan_digest", "version", "tensors", "bytes", "parts_held", "digests")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PARTS_HELD_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    shards: int
    plan_digest: str
    version: int
    tensors: int
    bytes: int
    parts_held: int
    digests: _containers.RepeatedCompositeFieldContainer[TensorDigest]
    def __init__(self, shard: _Optional[int] = ..., shards: _Optional[int] = ..., plan_digest: _Optional[str] = ..., version: _Optional[int] = ..., tensors: _Optional[int] = ..., bytes: _Optional[int] = ..., parts_held: _Optional[int] = ..., digests: _Optional[_Iterable[_Union[TensorDigest, _Mapping]]] = ...) -> None: ...
