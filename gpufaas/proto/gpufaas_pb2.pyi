from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InvokeRequest(_message.Message):
    __slots__ = ("call_id", "function", "payload", "timeout_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    function: str
    payload: bytes
    timeout_s: float
    def __init__(self, call_id: _Optional[str] = ..., function: _Optional[str] = ..., payload: _Optional[bytes] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InvokeReply(_message.Message):
    __slots__ = ("output", "gpu", "hit", "queue_s", "load_time_s", "inference_time_s", "attempts")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    HIT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    output: bytes
    gpu: str
    hit: bool
    queue_s: float
    load_time_s: float
    inference_time_s: float
    attempts: int
    def __init__(self, output: _Optional[bytes] = ..., gpu: _Optional[str] = ..., hit: _Optional[bool] = ..., queue_s: _Optional[float] = ..., load_time_s: _Optional[float] = ..., inference_time_s: _Optional[float] = ..., attempts: _Optional[int] = ...) -> None: ...

class ClusterRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("gpu", "node", "status", "memory_used_mb", "memory_capacity_mb", "lru", "local_queue", "running", "gpu_type")
    GPU_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_MB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CAPACITY_MB_FIELD_NUMBER: _ClassVar[int]
    LRU_FIELD_NUMBER: _ClassVar[int]
    LOCAL_QUEUE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    GPU_TYPE_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    node: str
    status: str
    memory_used_mb: int
    memory_capacity_mb: int
    lru: _containers.RepeatedScalarFieldContainer[str]
    local_queue: int
    running: str
    gpu_type: str
    def __init__(self, gpu: _Optional[str] = ..., node: _Optional[str] = ..., status: _Optional[str] = ..., memory_used_mb: _Optional[int] = ..., memory_capacity_mb: _Optional[int] = ..., lru: _Optional[_Iterable[str]] = ..., local_queue: _Optional[int] = ..., running: _Optional[str] = ..., gpu_type: _Optional[str] = ...) -> None: ...

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

class ClusterReply(_message.Message):
    __slots__ = ("gpus", "queue", "policy", "queue_capacity")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    queue: _containers.RepeatedCompositeFieldContainer[QueuedCall]
    policy: str
    queue_capacity: int
    def __init__(self, gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., queue: _Optional[_Iterable[_Union[QueuedCall, _Mapping]]] = ..., policy: _Optional[str] = ..., queue_capacity: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("call_id", "function", "model", "package_digest", "gpu", "evict", "payload", "timeout_s", "memory_mb", "package_url", "load_time_s", "inference_time_s")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_URL_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    function: str
    model: str
    package_digest: str
    gpu: str
    evict: _containers.RepeatedScalarFieldContainer[str]
    payload: bytes
    timeout_s: float
    memory_mb: int
    package_url: str
    load_time_s: float
    inference_time_s: float
    def __init__(self, call_id: _Optional[str] = ..., function: _Optional[str] = ..., model: _Optional[str] = ..., package_digest: _Optional[str] = ..., gpu: _Optional[str] = ..., evict: _Optional[_Iterable[str]] = ..., payload: _Optional[bytes] = ..., timeout_s: _Optional[float] = ..., memory_mb: _Optional[int] = ..., package_url: _Optional[str] = ..., load_time_s: _Optional[float] = ..., inference_time_s: _Optional[float] = ...) -> None: ...

class ExecuteReply(_message.Message):
    __slots__ = ("output", "loaded", "load_time_s", "inference_time_s", "peak_memory_mb")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    output: bytes
    loaded: bool
    load_time_s: float
    inference_time_s: float
    peak_memory_mb: int
    def __init__(self, output: _Optional[bytes] = ..., loaded: _Optional[bool] = ..., load_time_s: _Optional[float] = ..., inference_time_s: _Optional[float] = ..., peak_memory_mb: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("gpu", "model")
    GPU_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    gpu: str
    model: str
    def __init__(self, gpu: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EvictReply(_message.Message):
    __slots__ = ("evicted",)
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    evicted: bool
    def __init__(self, evicted: _Optional[bool] = ...) -> None: ...
