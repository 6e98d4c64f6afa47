from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Payload(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_UNSPECIFIED: _ClassVar[Payload]
    PAYLOAD_RAW: _ClassVar[Payload]
    PAYLOAD_DECODED: _ClassVar[Payload]

class OnError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_ERROR_UNSPECIFIED: _ClassVar[OnError]
    ON_ERROR_RAISE: _ClassVar[OnError]
    ON_ERROR_SKIP: _ClassVar[OnError]

class MixBy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MIX_BY_UNSPECIFIED: _ClassVar[MixBy]
    MIX_BY_SAMPLE: _ClassVar[MixBy]
    MIX_BY_BATCH: _ClassVar[MixBy]

class FieldLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FIELD_LAYOUT_UNSPECIFIED: _ClassVar[FieldLayout]
    FIELD_LAYOUT_TENSOR: _ClassVar[FieldLayout]
    FIELD_LAYOUT_BYTES: _ClassVar[FieldLayout]
PAYLOAD_UNSPECIFIED: Payload
PAYLOAD_RAW: Payload
PAYLOAD_DECODED: Payload
ON_ERROR_UNSPECIFIED: OnError
ON_ERROR_RAISE: OnError
ON_ERROR_SKIP: OnError
MIX_BY_UNSPECIFIED: MixBy
MIX_BY_SAMPLE: MixBy
MIX_BY_BATCH: MixBy
FIELD_LAYOUT_UNSPECIFIED: FieldLayout
FIELD_LAYOUT_TENSOR: FieldLayout
FIELD_LAYOUT_BYTES: FieldLayout

class ListDatasetsRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "dataset_id", "num_samples", "shard_sizes", "fields", "manifest_json", "field_names")
    class FieldsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZES_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    FIELD_NAMES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dataset_id: str
    num_samples: int
    shard_sizes: _containers.RepeatedScalarFieldContainer[int]
    fields: _containers.ScalarMap[str, str]
    manifest_json: str
    field_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., dataset_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., shard_sizes: _Optional[_Iterable[int]] = ..., fields: _Optional[_Mapping[str, str]] = ..., manifest_json: _Optional[str] = ..., field_names: _Optional[_Iterable[str]] = ...) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "protocol_version", "max_message_bytes", "max_batch_size", "max_batch_bytes", "max_image_side", "max_streams", "active_streams", "decode_available", "decode_device", "num_datasets", "media_available", "max_memory_bytes", "memory_in_use_bytes", "serves_block_stride", "orders", "priorities", "serves_windows")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_SIDE_FIELD_NUMBER: _ClassVar[int]
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DECODE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_DATASETS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_IN_USE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVES_BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    ORDERS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    SERVES_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    version: str
    protocol_version: int
    max_message_bytes: int
    max_batch_size: int
    max_batch_bytes: int
    max_image_side: int
    max_streams: int
    active_streams: int
    decode_available: bool
    decode_device: str
    num_datasets: int
    media_available: bool
    max_memory_bytes: int
    memory_in_use_bytes: int
    serves_block_stride: bool
    orders: _containers.RepeatedScalarFieldContainer[int]
    priorities: _containers.RepeatedCompositeFieldContainer[PriorityUse]
    serves_windows: bool
    def __init__(self, version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_batch_bytes: _Optional[int] = ..., max_image_side: _Optional[int] = ..., max_streams: _Optional[int] = ..., active_streams: _Optional[int] = ..., decode_available: _Optional[bool] = ..., decode_device: _Optional[str] = ..., num_datasets: _Optional[int] = ..., media_available: _Optional[bool] = ..., max_memory_bytes: _Optional[int] = ..., memory_in_use_bytes: _Optional[int] = ..., serves_block_stride: _Optional[bool] = ..., orders: _Optional[_Iterable[int]] = ..., priorities: _Optional[_Iterable[_Union[PriorityUse, _Mapping]]] = ..., serves_windows: _Optional[bool] = ...) -> None: ...

class PriorityUse(_message.Message):
    __slots__ = ("priority", "streams", "paused", "queued", "batches", "busy_s", "paused_s", "utilisation")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    priority: int
    streams: int
    paused: int
    queued: int
    batches: int
    busy_s: float
    paused_s: float
    utilisation: float
    def __init__(self, priority: _Optional[int] = ..., streams: _Optional[int] = ..., paused: _Optional[int] = ..., queued: _Optional[int] = ..., batches: _Optional[int] = ..., busy_s: _Optional[float] = ..., paused_s: _Optional[float] = ..., utilisation: _Optional[float] = ...) -> None: ...

class ImageTransformSpec(_message.Message):
    __slots__ = ("size", "train", "scale_min", "scale_max", "ratio_min", "ratio_max", "resize", "flip", "mean", "std", "layout", "dtype")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    SCALE_MIN_FIELD_NUMBER: _ClassVar[int]
    SCALE_MAX_FIELD_NUMBER: _ClassVar[int]
    RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    FLIP_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    size: int
    train: bool
    scale_min: float
    scale_max: float
    ratio_min: float
    ratio_max: float
    resize: int
    flip: float
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    layout: str
    dtype: str
    def __init__(self, size: _Optional[int] = ..., train: _Optional[bool] = ..., scale_min: _Optional[float] = ..., scale_max: _Optional[float] = ..., ratio_min: _Optional[float] = ..., ratio_max: _Optional[float] = ..., resize: _Optional[int] = ..., flip: _Optional[float] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., layout: _Optional[str] = ..., dtype: _Optional[str] = ...) -> None: ...

class BatchRequest(_message.Message):
    __slots__ = ("dataset", "dataset_id", "seed", "epoch", "shuffle", "shuffle_window", "drop_last", "batch_size", "rank", "world_size", "start_position", "payload", "transform", "fields", "on_error", "max_batches", "max_chunk_bytes", "mix", "share", "bulk", "block_batches", "block_stride", "checks_item_crc32", "priority", "job", "understands_pause", "media", "windows")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    TRANSFORM_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    ON_ERROR_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIX_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BATCHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    CHECKS_ITEM_CRC32_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    UNDERSTANDS_PAUSE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    dataset_id: str
    seed: int
    epoch: int
    shuffle: bool
    shuffle_window: int
    drop_last: bool
    batch_size: int
    rank: int
    world_size: int
    start_position: int
    payload: Payload
    transform: ImageTransformSpec
    fields: _containers.RepeatedScalarFieldContainer[str]
    on_error: OnError
    max_batches: int
    max_chunk_bytes: int
    mix: MixSpec
    share: str
    bulk: bool
    block_batches: int
    block_stride: int
    checks_item_crc32: bool
    priority: int
    job: str
    understands_pause: bool
    media: _containers.RepeatedCompositeFieldContainer[MediaTransformSpec]
    windows: PassWindows
    def __init__(self, dataset: _Optional[str] = ..., dataset_id: _Optional[str] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., shuffle: _Optional[bool] = ..., shuffle_window: _Optional[int] = ..., drop_last: _Optional[bool] = ..., batch_size: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., start_position: _Optional[int] = ..., payload: _Optional[_Union[Payload, str]] = ..., transform: _Optional[_Union[ImageTransformSpec, _Mapping]] = ..., fields: _Optional[_Iterable[str]] = ..., on_error: _Optional[_Union[OnError, str]] = ..., max_batches: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., mix: _Optional[_Union[MixSpec, _Mapping]] = ..., share: _Optional[str] = ..., bulk: _Optional[bool] = ..., block_batches: _Optional[int] = ..., block_stride: _Optional[int] = ..., checks_item_crc32: _Optional[bool] = ..., priority: _Optional[int] = ..., job: _Optional[str] = ..., understands_pause: _Optional[bool] = ..., media: _Optional[_Iterable[_Union[MediaTransformSpec, _Mapping]]] = ..., windows: _Optional[_Union[PassWindows, _Mapping]] = ...) -> None: ...

class PassWindows(_message.Message):
    __slots__ = ("dataset", "shard", "mode", "fps", "window", "size", "chunk_s", "fields", "start_sample", "start_field", "start_window", "max_seconds")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_S_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    START_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_FIELD_NUMBER: _ClassVar[int]
    START_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    shard: int
    mode: str
    fps: float
    window: int
    size: int
    chunk_s: float
    fields: _containers.RepeatedScalarFieldContainer[str]
    start_sample: int
    start_field: int
    start_window: int
    max_seconds: float
    def __init__(self, dataset: _Optional[str] = ..., shard: _Optional[int] = ..., mode: _Optional[str] = ..., fps: _Optional[float] = ..., window: _Optional[int] = ..., size: _Optional[int] = ..., chunk_s: _Optional[float] = ..., fields: _Optional[_Iterable[str]] = ..., start_sample: _Optional[int] = ..., start_field: _Optional[int] = ..., start_window: _Optional[int] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class MixSpec(_message.Message):
    __slots__ = ("sources", "samples_per_epoch", "mix_by", "schedule")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MIX_BY_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[MixSource]
    samples_per_epoch: int
    mix_by: MixBy
    schedule: _containers.RepeatedCompositeFieldContainer[MixPhase]
    def __init__(self, sources: _Optional[_Iterable[_Union[MixSource, _Mapping]]] = ..., samples_per_epoch: _Optional[int] = ..., mix_by: _Optional[_Union[MixBy, str]] = ..., schedule: _Optional[_Iterable[_Union[MixPhase, _Mapping]]] = ...) -> None: ...

class MixPhase(_message.Message):
    __slots__ = ("tokens", "weights")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[int] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class MixSource(_message.Message):
    __slots__ = ("dataset", "dataset_id", "name", "weight", "repeat", "samples")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    dataset_id: str
    name: str
    weight: float
    repeat: float
    samples: int
    def __init__(self, dataset: _Optional[str] = ..., dataset_id: _Optional[str] = ..., name: _Optional[str] = ..., weight: _Optional[float] = ..., repeat: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class BatchChunk(_message.Message):
    __slots__ = ("step", "position", "epoch", "chunk_index", "last", "header", "data", "bulk", "pause")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    step: int
    position: int
    epoch: int
    chunk_index: int
    last: bool
    header: BatchHeader
    data: bytes
    bulk: BulkOffer
    pause: StreamPause
    def __init__(self, step: _Optional[int] = ..., position: _Optional[int] = ..., epoch: _Optional[int] = ..., chunk_index: _Optional[int] = ..., last: _Optional[bool] = ..., header: _Optional[_Union[BatchHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., bulk: _Optional[_Union[BulkOffer, _Mapping]] = ..., pause: _Optional[_Union[StreamPause, _Mapping]] = ...) -> None: ...

class StreamPause(_message.Message):
    __slots__ = ("reason", "by_priority", "paused_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    BY_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PAUSED_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    by_priority: int
    paused_s: float
    def __init__(self, reason: _Optional[str] = ..., by_priority: _Optional[int] = ..., paused_s: _Optional[float] = ...) -> None: ...

class BulkOffer(_message.Message):
    __slots__ = ("ticket", "port")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    port: int
    def __init__(self, ticket: _Optional[bytes] = ..., port: _Optional[int] = ...) -> None: ...

class BatchHeader(_message.Message):
    __slots__ = ("num_samples", "keys", "fields", "skipped", "body_nbytes", "sources", "skipped_keys", "end_position", "shared")
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BODY_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_KEYS_FIELD_NUMBER: _ClassVar[int]
    END_POSITION_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    num_samples: int
    keys: _containers.RepeatedScalarFieldContainer[str]
    fields: _containers.RepeatedCompositeFieldContainer[FieldData]
    skipped: int
    body_nbytes: int
    sources: _containers.RepeatedScalarFieldContainer[str]
    skipped_keys: _containers.RepeatedScalarFieldContainer[str]
    end_position: int
    shared: bool
    def __init__(self, num_samples: _Optional[int] = ..., keys: _Optional[_Iterable[str]] = ..., fields: _Optional[_Iterable[_Union[FieldData, _Mapping]]] = ..., skipped: _Optional[int] = ..., body_nbytes: _Optional[int] = ..., sources: _Optional[_Iterable[str]] = ..., skipped_keys: _Optional[_Iterable[str]] = ..., end_position: _Optional[int] = ..., shared: _Optional[bool] = ...) -> None: ...

class FieldData(_message.Message):
    __slots__ = ("name", "layout", "dtype", "shape", "item_nbytes", "nbytes", "item_crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ITEM_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ITEM_CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: FieldLayout
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    item_nbytes: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    item_crc32: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[FieldLayout, str]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., item_nbytes: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., item_crc32: _Optional[_Iterable[int]] = ...) -> None: ...

class MediaTransformSpec(_message.Message):
    __slots__ = ("field", "video", "audio")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    field: str
    video: VideoTransformSpec
    audio: AudioTransformSpec
    def __init__(self, field: _Optional[str] = ..., video: _Optional[_Union[VideoTransformSpec, _Mapping]] = ..., audio: _Optional[_Union[AudioTransformSpec, _Mapping]] = ...) -> None: ...

class VideoTransformSpec(_message.Message):
    __slots__ = ("frames", "stride", "clips", "sampling", "size", "train", "dtype", "layout", "max_pixels", "max_frames", "scale_min", "scale_max", "ratio_min", "ratio_max", "resize", "flip", "mean", "std", "no_normalize")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    CLIPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SCALE_MIN_FIELD_NUMBER: _ClassVar[int]
    SCALE_MAX_FIELD_NUMBER: _ClassVar[int]
    RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    RESIZE_FIELD_NUMBER: _ClassVar[int]
    FLIP_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    NO_NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    frames: int
    stride: int
    clips: int
    sampling: str
    size: int
    train: bool
    dtype: str
    layout: str
    max_pixels: int
    max_frames: int
    scale_min: float
    scale_max: float
    ratio_min: float
    ratio_max: float
    resize: int
    flip: float
    mean: _containers.RepeatedScalarFieldContainer[float]
    std: _containers.RepeatedScalarFieldContainer[float]
    no_normalize: bool
    def __init__(self, frames: _Optional[int] = ..., stride: _Optional[int] = ..., clips: _Optional[int] = ..., sampling: _Optional[str] = ..., size: _Optional[int] = ..., train: _Optional[bool] = ..., dtype: _Optional[str] = ..., layout: _Optional[str] = ..., max_pixels: _Optional[int] = ..., max_frames: _Optional[int] = ..., scale_min: _Optional[float] = ..., scale_max: _Optional[float] = ..., ratio_min: _Optional[float] = ..., ratio_max: _Optional[float] = ..., resize: _Optional[int] = ..., flip: _Optional[float] = ..., mean: _Optional[_Iterable[float]] = ..., std: _Optional[_Iterable[float]] = ..., no_normalize: _Optional[bool] = ...) -> None: ...

class AudioTransformSpec(_message.Message):
    __slots__ = ("sample_rate", "seconds", "crop", "mono", "features", "n_mels", "n_fft", "hop", "max_seconds", "channels")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CROP_FIELD_NUMBER: _ClassVar[int]
    MONO_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    N_MELS_FIELD_NUMBER: _ClassVar[int]
    N_FFT_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    seconds: float
    crop: str
    mono: bool
    features: str
    n_mels: int
    n_fft: int
    hop: int
    max_seconds: float
    channels: int
    def __init__(self, sample_rate: _Optional[int] = ..., seconds: _Optional[float] = ..., crop: _Optional[str] = ..., mono: _Optional[bool] = ..., features: _Optional[str] = ..., n_mels: _Optional[int] = ..., n_fft: _Optional[int] = ..., hop: _Optional[int] = ..., max_seconds: _Optional[float] = ..., channels: _Optional[int] = ...) -> None: ...
