from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATUS_UNSPECIFIED: _ClassVar[Status]
    NOT_FOUND: _ClassVar[Status]
    INVALID: _ClassVar[Status]
    OVERLOADED: _ClassVar[Status]
    UNAVAILABLE: _ClassVar[Status]
    DEADLINE: _ClassVar[Status]
    FUNCTION_FAILED: _ClassVar[Status]
    TOO_LARGE: _ClassVar[Status]
    RESULT_TOO_LARGE: _ClassVar[Status]
    UNAUTHENTICATED: _ClassVar[Status]
    FENCED: _ClassVar[Status]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OK: _ClassVar[Outcome]
    HANDLER_ERROR: _ClassVar[Outcome]
    LOAD_FAILED: _ClassVar[Outcome]
    TIMEOUT: _ClassVar[Outcome]
    WORKER_DIED: _ClassVar[Outcome]
    REFUSED: _ClassVar[Outcome]
    INVALID_INPUT: _ClassVar[Outcome]
    OUTPUT_TOO_LARGE: _ClassVar[Outcome]
    OUTPUT_INVALID: _ClassVar[Outcome]
STATUS_UNSPECIFIED: Status
NOT_FOUND: Status
INVALID: Status
OVERLOADED: Status
UNAVAILABLE: Status
DEADLINE: Status
FUNCTION_FAILED: Status
TOO_LARGE: Status
RESULT_TOO_LARGE: Status
UNAUTHENTICATED: Status
FENCED: Status
OUTCOME_UNSPECIFIED: Outcome
OK: Outcome
HANDLER_ERROR: Outcome
LOAD_FAILED: Outcome
TIMEOUT: Outcome
WORKER_DIED: Outcome
REFUSED: Outcome
INVALID_INPUT: Outcome
OUTPUT_TOO_LARGE: Outcome
OUTPUT_INVALID: Outcome

class Place(_message.Message):
    __slots__ = ("call_id", "function", "timeout_s", "payload_bytes", "lease", "worker_died", "given_call_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    WORKER_DIED_FIELD_NUMBER: _ClassVar[int]
    GIVEN_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    function: str
    timeout_s: float
    payload_bytes: int
    lease: bool
    worker_died: bool
    given_call_id: bool
    def __init__(self, call_id: _Optional[str] = ..., function: _Optional[str] = ..., timeout_s: _Optional[float] = ..., payload_bytes: _Optional[int] = ..., lease: _Optional[bool] = ..., worker_died: _Optional[bool] = ..., given_call_id: _Optional[bool] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("call_id", "attempt", "node", "node_address", "gpu", "hit", "queue_s", "token", "epoch", "lease_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    attempt: int
    node: str
    node_address: str
    gpu: str
    hit: bool
    queue_s: float
    token: bytes
    epoch: int
    lease_s: float
    def __init__(self, call_id: _Optional[str] = ..., attempt: _Optional[int] = ..., node: _Optional[str] = ..., node_address: _Optional[str] = ..., gpu: _Optional[str] = ..., hit: _Optional[bool] = ..., queue_s: _Optional[float] = ..., token: _Optional[bytes] = ..., epoch: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("status", "message")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: Status
    message: str
    def __init__(self, status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Rejection(_message.Message):
    __slots__ = ("call_id", "status", "message")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    status: Status
    message: str
    def __init__(self, call_id: _Optional[str] = ..., status: _Optional[_Union[Status, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Abandon(_message.Message):
    __slots__ = ("call_id", "attempt", "reason", "detail")
    class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REASON_UNSPECIFIED: _ClassVar[Abandon.Reason]
        CANCELLED: _ClassVar[Abandon.Reason]
        NODE_UNREACHABLE: _ClassVar[Abandon.Reason]
        REFUSED: _ClassVar[Abandon.Reason]
    REASON_UNSPECIFIED: Abandon.Reason
    CANCELLED: Abandon.Reason
    NODE_UNREACHABLE: Abandon.Reason
    REFUSED: Abandon.Reason
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    attempt: int
    reason: Abandon.Reason
    detail: str
    def __init__(self, call_id: _Optional[str] = ..., attempt: _Optional[int] = ..., reason: _Optional[_Union[Abandon.Reason, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class Grant(_message.Message):
    __slots__ = ("scheduler_id", "call_id", "attempt", "node", "gpu", "gpu_seq", "function", "model", "package_digest", "memory_mb", "evict", "claim_by_unix_s", "expires_unix_s", "load_time_s", "inference_time_s", "worker", "epoch", "lease_s")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    GPU_SEQ_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_BY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    call_id: str
    attempt: int
    node: str
    gpu: str
    gpu_seq: int
    function: str
    model: str
    package_digest: str
    memory_mb: int
    evict: _containers.RepeatedScalarFieldContainer[str]
    claim_by_unix_s: float
    expires_unix_s: float
    load_time_s: float
    inference_time_s: float
    worker: bytes
    epoch: int
    lease_s: float
    def __init__(self, scheduler_id: _Optional[str] = ..., call_id: _Optional[str] = ..., attempt: _Optional[int] = ..., node: _Optional[str] = ..., gpu: _Optional[str] = ..., gpu_seq: _Optional[int] = ..., function: _Optional[str] = ..., model: _Optional[str] = ..., package_digest: _Optional[str] = ..., memory_mb: _Optional[int] = ..., evict: _Optional[_Iterable[str]] = ..., claim_by_unix_s: _Optional[float] = ..., expires_unix_s: _Optional[float] = ..., load_time_s: _Optional[float] = ..., inference_time_s: _Optional[float] = ..., worker: _Optional[bytes] = ..., epoch: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class Execute(_message.Message):
    __slots__ = ("token", "content_type", "lease_call_id", "timeout_s")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    LEASE_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    content_type: str
    lease_call_id: str
    timeout_s: float
    def __init__(self, token: _Optional[bytes] = ..., content_type: _Optional[str] = ..., lease_call_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class MissStages(_message.Message):
    __slots__ = ("fetch_s", "start_s", "context_s", "load_s", "prefetch_s", "spare_start_s", "spare_context_s", "host_s", "from_host", "pool_s", "from_pool")
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_S_FIELD_NUMBER: _ClassVar[int]
    SPARE_START_S_FIELD_NUMBER: _ClassVar[int]
    SPARE_CONTEXT_S_FIELD_NUMBER: _ClassVar[int]
    HOST_S_FIELD_NUMBER: _ClassVar[int]
    FROM_HOST_FIELD_NUMBER: _ClassVar[int]
    POOL_S_FIELD_NUMBER: _ClassVar[int]
    FROM_POOL_FIELD_NUMBER: _ClassVar[int]
    fetch_s: float
    start_s: float
    context_s: float
    load_s: float
    prefetch_s: float
    spare_start_s: float
    spare_context_s: float
    host_s: float
    from_host: bool
    pool_s: float
    from_pool: bool
    def __init__(self, fetch_s: _Optional[float] = ..., start_s: _Optional[float] = ..., context_s: _Optional[float] = ..., load_s: _Optional[float] = ..., prefetch_s: _Optional[float] = ..., spare_start_s: _Optional[float] = ..., spare_context_s: _Optional[float] = ..., host_s: _Optional[float] = ..., from_host: _Optional[bool] = ..., pool_s: _Optional[float] = ..., from_pool: _Optional[bool] = ...) -> None: ...

class ExecuteReply(_message.Message):
    __slots__ = ("outcome", "message", "loaded", "load_time_s", "inference_time_s", "batch_calls", "stages", "content_type", "node_s")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_CALLS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    NODE_S_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    message: str
    loaded: bool
    load_time_s: float
    inference_time_s: float
    batch_calls: int
    stages: MissStages
    content_type: str
    node_s: float
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., message: _Optional[str] = ..., loaded: _Optional[bool] = ..., load_time_s: _Optional[float] = ..., inference_time_s: _Optional[float] = ..., batch_calls: _Optional[int] = ..., stages: _Optional[_Union[MissStages, _Mapping]] = ..., content_type: _Optional[str] = ..., node_s: _Optional[float] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("call_id", "attempt", "gpu", "outcome", "loaded", "load_time_s", "inference_time_s", "peak_memory_mb", "batch_calls", "worker_lost", "lease_call_id", "lease_ended")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    BATCH_CALLS_FIELD_NUMBER: _ClassVar[int]
    WORKER_LOST_FIELD_NUMBER: _ClassVar[int]
    LEASE_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ENDED_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    attempt: int
    gpu: str
    outcome: Outcome
    loaded: bool
    load_time_s: float
    inference_time_s: float
    peak_memory_mb: int
    batch_calls: int
    worker_lost: bool
    lease_call_id: str
    lease_ended: bool
    def __init__(self, call_id: _Optional[str] = ..., attempt: _Optional[int] = ..., gpu: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., loaded: _Optional[bool] = ..., load_time_s: _Optional[float] = ..., inference_time_s: _Optional[float] = ..., peak_memory_mb: _Optional[int] = ..., batch_calls: _Optional[int] = ..., worker_lost: _Optional[bool] = ..., lease_call_id: _Optional[str] = ..., lease_ended: _Optional[bool] = ...) -> None: ...

class Attach(_message.Message):
    __slots__ = ("scheduler_id", "token_key", "epoch")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_KEY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    token_key: bytes
    epoch: int
    def __init__(self, scheduler_id: _Optional[str] = ..., token_key: _Optional[bytes] = ..., epoch: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("gpu", "model", "memory_mb")
    GPU_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    model: str
    memory_mb: int
    def __init__(self, gpu: _Optional[str] = ..., model: _Optional[str] = ..., memory_mb: _Optional[int] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("node", "incarnation", "workers", "parked", "host_memory_mb", "holdings")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: str
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    parked: _containers.RepeatedCompositeFieldContainer[Worker]
    host_memory_mb: int
    holdings: Holdings
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., parked: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ..., host_memory_mb: _Optional[int] = ..., holdings: _Optional[_Union[Holdings, _Mapping]] = ...) -> None: ...

class Holdings(_message.Message):
    __slots__ = ("staged", "pooled", "disk_used_bytes", "disk_budget_bytes", "pool_used_bytes", "pool_budget_bytes")
    STAGED_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    staged: _containers.RepeatedScalarFieldContainer[str]
    pooled: _containers.RepeatedScalarFieldContainer[str]
    disk_used_bytes: int
    disk_budget_bytes: int
    pool_used_bytes: int
    pool_budget_bytes: int
    def __init__(self, staged: _Optional[_Iterable[str]] = ..., pooled: _Optional[_Iterable[str]] = ..., disk_used_bytes: _Optional[int] = ..., disk_budget_bytes: _Optional[int] = ..., pool_used_bytes: _Optional[int] = ..., pool_budget_bytes: _Optional[int] = ...) -> None: ...

class Stage(_message.Message):
    __slots__ = ("packages",)
    PACKAGES_FIELD_NUMBER: _ClassVar[int]
    packages: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, packages: _Optional[_Iterable[str]] = ...) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("staged",)
    STAGED_FIELD_NUMBER: _ClassVar[int]
    staged: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, staged: _Optional[_Iterable[str]] = ...) -> None: ...

class WorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GrantRef(_message.Message):
    __slots__ = ("call_id", "attempt")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    attempt: int
    def __init__(self, call_id: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class Revoke(_message.Message):
    __slots__ = ("grants", "claim_by_unix_s", "if_idle", "drained")
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_BY_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    IF_IDLE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    grants: _containers.RepeatedCompositeFieldContainer[GrantRef]
    claim_by_unix_s: float
    if_idle: bool
    drained: bool
    def __init__(self, grants: _Optional[_Iterable[_Union[GrantRef, _Mapping]]] = ..., claim_by_unix_s: _Optional[float] = ..., if_idle: _Optional[bool] = ..., drained: _Optional[bool] = ...) -> None: ...

class RevokeReply(_message.Message):
    __slots__ = ("unseen", "seen", "busy")
    UNSEEN_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    unseen: _containers.RepeatedCompositeFieldContainer[GrantRef]
    seen: _containers.RepeatedCompositeFieldContainer[GrantRef]
    busy: _containers.RepeatedCompositeFieldContainer[GrantRef]
    def __init__(self, unseen: _Optional[_Iterable[_Union[GrantRef, _Mapping]]] = ..., seen: _Optional[_Iterable[_Union[GrantRef, _Mapping]]] = ..., busy: _Optional[_Iterable[_Union[GrantRef, _Mapping]]] = ...) -> None: ...

class Evict(_message.Message):
    __slots__ = ("gpu", "models", "to_host", "gpu_seq", "if_idle")
    GPU_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    TO_HOST_FIELD_NUMBER: _ClassVar[int]
    GPU_SEQ_FIELD_NUMBER: _ClassVar[int]
    IF_IDLE_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    models: _containers.RepeatedScalarFieldContainer[str]
    to_host: bool
    gpu_seq: int
    if_idle: bool
    def __init__(self, gpu: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., to_host: _Optional[bool] = ..., gpu_seq: _Optional[int] = ..., if_idle: _Optional[bool] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, evicted: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterRequest(_message.Message):
    __slots__ = ("summary", "queue_limit")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    summary: bool
    queue_limit: int
    def __init__(self, summary: _Optional[bool] = ..., queue_limit: _Optional[int] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("gpu", "node", "status", "memory_used_mb", "memory_capacity_mb", "lru", "local_queue", "running", "gpu_type", "slots", "host_tier", "running_models")
    GPU_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_MB_FIELD_NUMBER: _ClassVar[int]
    LRU_FIELD_NUMBER: _ClassVar[int]
    LOCAL_QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    RUNNING_MODELS_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    node: str
    status: str
    memory_used_mb: int
    memory_capacity_mb: int
    lru: _containers.RepeatedScalarFieldContainer[str]
    local_queue: int
    running: _containers.RepeatedScalarFieldContainer[str]
    gpu_type: str
    slots: int
    host_tier: _containers.RepeatedScalarFieldContainer[str]
    running_models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gpu: _Optional[str] = ..., node: _Optional[str] = ..., status: _Optional[str] = ..., memory_used_mb: _Optional[int] = ..., memory_capacity_mb: _Optional[int] = ..., lru: _Optional[_Iterable[str]] = ..., local_queue: _Optional[int] = ..., running: _Optional[_Iterable[str]] = ..., gpu_type: _Optional[str] = ..., slots: _Optional[int] = ..., host_tier: _Optional[_Iterable[str]] = ..., running_models: _Optional[_Iterable[str]] = ...) -> None: ...

class QueuedCall(_message.Message):
    __slots__ = ("call_id", "function", "model", "waited_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    function: str
    model: str
    waited_s: float
    def __init__(self, call_id: _Optional[str] = ..., function: _Optional[str] = ..., model: _Optional[str] = ..., waited_s: _Optional[float] = ...) -> None: ...

class EvictionRecord(_message.Message):
    __slots__ = ("gpu", "model", "reason", "age_s")
    GPU_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    model: str
    reason: str
    age_s: float
    def __init__(self, gpu: _Optional[str] = ..., model: _Optional[str] = ..., reason: _Optional[str] = ..., age_s: _Optional[float] = ...) -> None: ...

class ClusterReply(_message.Message):
    __slots__ = ("gpus", "queue", "policy", "queue_capacity", "evictions", "scheduler", "epoch", "queue_length")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    queue: _containers.RepeatedCompositeFieldContainer[QueuedCall]
    policy: str
    queue_capacity: int
    evictions: _containers.RepeatedCompositeFieldContainer[EvictionRecord]
    scheduler: str
    epoch: int
    queue_length: int
    def __init__(self, gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., queue: _Optional[_Iterable[_Union[QueuedCall, _Mapping]]] = ..., policy: _Optional[str] = ..., queue_capacity: _Optional[int] = ..., evictions: _Optional[_Iterable[_Union[EvictionRecord, _Mapping]]] = ..., scheduler: _Optional[str] = ..., epoch: _Optional[int] = ..., queue_length: _Optional[int] = ...) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ("pid", "import_s", "context_s", "context_mb", "network_isolated")
    PID_FIELD_NUMBER: _ClassVar[int]
    IMPORT_S_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_S_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_MB_FIELD_NUMBER: _ClassVar[int]
    NETWORK_ISOLATED_FIELD_NUMBER: _ClassVar[int]
    pid: int
    import_s: float
    context_s: float
    context_mb: int
    network_isolated: bool
    def __init__(self, pid: _Optional[int] = ..., import_s: _Optional[float] = ..., context_s: _Optional[float] = ..., context_mb: _Optional[int] = ..., network_isolated: _Optional[bool] = ...) -> None: ...

class LoadModel(_message.Message):
    __slots__ = ("model", "package_dir", "memory_mb", "worker", "load_time_s", "inference_time_s", "max_result_bytes", "uid", "gid", "data_limit_mb", "max_processes", "max_file_mb", "home_dir", "pooled", "layer_dir")
    class PooledEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_DIR_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RESULT_BYTES_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    DATA_LIMIT_MB_FIELD_NUMBER: _ClassVar[int]
    MAX_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MAX_FILE_MB_FIELD_NUMBER: _ClassVar[int]
    HOME_DIR_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    LAYER_DIR_FIELD_NUMBER: _ClassVar[int]
    model: str
    package_dir: str
    memory_mb: int
    worker: bytes
    load_time_s: float
    inference_time_s: float
    max_result_bytes: int
    uid: int
    gid: int
    data_limit_mb: int
    max_processes: int
    max_file_mb: int
    home_dir: str
    pooled: _containers.ScalarMap[str, str]
    layer_dir: str
    def __init__(self, model: _Optional[str] = ..., package_dir: _Optional[str] = ..., memory_mb: _Optional[int] = ..., worker: _Optional[bytes] = ..., load_time_s: _Optional[float] = ..., inference_time_s: _Optional[float] = ..., max_result_bytes: _Optional[int] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., data_limit_mb: _Optional[int] = ..., max_processes: _Optional[int] = ..., max_file_mb: _Optional[int] = ..., home_dir: _Optional[str] = ..., pooled: _Optional[_Mapping[str, str]] = ..., layer_dir: _Optional[str] = ...) -> None: ...

class ModelLoaded(_message.Message):
    __slots__ = ("ok", "error", "load_s", "peak_memory_mb")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    load_s: float
    peak_memory_mb: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., load_s: _Optional[float] = ..., peak_memory_mb: _Optional[int] = ...) -> None: ...

class Call(_message.Message):
    __slots__ = ("call_id", "content_type")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    content_type: str
    def __init__(self, call_id: _Optional[str] = ..., content_type: _Optional[str] = ...) -> None: ...

class CallResult(_message.Message):
    __slots__ = ("call_id", "outcome", "message", "inference_s", "batch_calls", "peak_memory_mb", "content_type")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_CALLS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    outcome: Outcome
    message: str
    inference_s: float
    batch_calls: int
    peak_memory_mb: int
    content_type: str
    def __init__(self, call_id: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., message: _Optional[str] = ..., inference_s: _Optional[float] = ..., batch_calls: _Optional[int] = ..., peak_memory_mb: _Optional[int] = ..., content_type: _Optional[str] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("nonce", "proof")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    proof: bytes
    def __init__(self, nonce: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...
