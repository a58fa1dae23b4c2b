"""The driver <-> worker wire format: one msgpack message per step each way.

Every type that crosses the wire is a msgspec Struct defined here, so the driver and the
worker import the same definitions. Token ids, logprobs and ranks travel as raw
little-endian bytes (``Int32Array`` / ``Float32Array`` say the dtype), never as lists of
Python ints. Decoding validates every field's type; a malformed message or one from
another protocol version raises ``ProtocolError`` naming the field.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec
import numpy as np

from sampler.params import SamplingParams
from worker.lora_adapter import LoRAAdapter
from worker.pooling import PoolerSpec

PROTOCOL_VERSION = 4

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class ProtocolError(ValueError):
    """A step message or reply that cannot be decoded or does not fit the batch."""


class _RawArray(msgspec.Struct, array_like=True, frozen=True):
    """A 1-D array as raw little-endian bytes; subclasses fix the dtype."""

    data: bytes
    dtype: ClassVar[np.dtype]

    def __post_init__(self) -> None:
        if len(self.data) % self.dtype.itemsize:
            raise ValueError(
                f"{len(self.data)} bytes is not a whole number of {self.dtype.name} values"
            )

    def numpy(self) -> np.ndarray:
        """A read-only view of the values (no copy)."""
        return np.frombuffer(self.data, dtype=self.dtype)

    def __len__(self) -> int:
        return len(self.data) // self.dtype.itemsize

    @classmethod
    def of(cls, values: object) -> _RawArray:
        """From any array-like; values that do not fit the dtype raise ``ValueError``
        instead of wrapping around or rounding."""
        source = np.asarray(values)
        array = source.astype(cls.dtype)
        if source.size and source.dtype != cls.dtype:
            if cls.dtype.kind == "i" and source.dtype.kind not in "iub":
                raise ValueError(f"{cls.__name__} holds integers, got {source.dtype} values")
            if not np.array_equal(array, source) and not (
                cls.dtype.kind == "f" and np.allclose(array, source, rtol=1e-6, equal_nan=True)
            ):
                raise ValueError(f"values out of range for {cls.dtype.name}")
        return cls(np.ascontiguousarray(array).tobytes())


class Int32Array(_RawArray, frozen=True):
    dtype: ClassVar[np.dtype] = np.dtype("<i4")


class Float32Array(_RawArray, frozen=True):
    dtype: ClassVar[np.dtype] = np.dtype("<f4")


EMPTY_I32 = Int32Array(b"")
EMPTY_F32 = Float32Array(b"")


# -- loading ---------------------------------------------------------------------------


class WorkerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a loaded worker tells the driver."""

    model_name: str
    device: str
    dtype: str
    vocab_size: int
    eos_token_ids: list[int]
    max_model_len: int
    max_num_seqs: int  # rows of the persistent batch
    kv_cache_bytes: int
    num_spec_tokens: int
    num_kv_blocks: int = 0  # the KV pool: blocks of kv_block_size tokens
    kv_block_size: int = 16
    #: layers whose weights are kept quantized, by format ("gguf Q4_1": 210, ...); empty: float
    quantized: dict[str, int] = {}
    #: bytes of the model's weights as loaded (quantized ones as stored)
    weight_bytes: int = 0
    #: with enable_lora: the linears an adapter may attach to, name -> [in, out]
    lora_targets: dict[str, list[int]] = {}
    #: a pooling model's pooler (None: a generative model)
    pooler: PoolerSpec | None = None


# -- driver -> worker ------------------------------------------------------------------


class GroupRank(msgspec.Struct, kw_only=True, frozen=True):
    """What the driver tells one rank of a group at load: who it is and where the
    group meets."""

    rank: int
    world_size: int
    #: ``tcp://host:port`` of rank 0's rendezvous store
    init_method: str
    #: a file under /dev/shm for the stage's shared-memory all-reduce (None: gloo);
    #: the same name for every tensor rank of one stage, one per stage
    shm_path: str | None = None
    #: seconds any collective may wait for the other ranks
    timeout_s: float = 60.0


class AddedRequest(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """A request placed into ``row``: new, or resumed with the output it already has
    (after preemption or a lost worker). The worker recomputes its cache from scratch."""

    row: NonNegative
    request_id: str
    params: SamplingParams
    prompt_token_ids: Int32Array
    output_token_ids: Int32Array = EMPTY_I32
    #: uniforms a seeded request has drawn so far (one per sampled token, two more per
    #: verified draft); None: one per output token (exact without drafts)
    num_generator_draws: NonNegative | None = None
    #: leading tokens whose KV is already in the blocks it arrives with (a prefix-cache
    #: hit, a whole number of blocks); it computes from there
    num_computed_tokens: NonNegative = 0
    #: the LoRA adapter it runs with (None: the base model)
    lora: LoRAAdapter | None = None
    #: a pooling request to an encoder: the token type of each prompt token (a
    #: cross-encoder's pair: 0 for the first text, 1 for the second); None: all 0
    token_type_ids: Int32Array | None = None


class MovedRows(msgspec.Struct, array_like=True, frozen=True):
    """Row ``a`` moves to row ``b`` (b's old contents are dropped), or they swap."""

    a: NonNegative
    b: NonNegative
    swap: bool = False


class StepRequest(msgspec.Struct, kw_only=True, frozen=True, tag="step"):
    """One engine step for one worker: the batch changes, then what to run.

    Changes apply in order: ``removed``, ``added`` (into the given rows; a row freed this
    step may be refilled), ``moved`` in list order; afterwards rows
    ``0..batch_size-1`` all hold requests. Then row ``r`` appends ``num_new_blocks[r]``
    KV blocks (the next ones of ``new_block_ids``) to its block table; an added row
    arrives with none and gets all of its blocks here (its cached prefix first).
    ``num_scheduled_tokens[row]`` is how many of the row's known tokens (prompt, then
    output) to run this step: a prefill chunk, 1 for a decode, 0 to skip the row. A row
    samples when its chunk reaches its last known token.
    """

    version: int
    step_id: NonNegative
    batch_size: NonNegative
    removed: list[NonNegative] = []
    added: list[AddedRequest] = []
    moved: list[MovedRows] = []
    num_scheduled_tokens: Int32Array = EMPTY_I32
    num_new_blocks: Int32Array = EMPTY_I32  # per row, batch_size entries (or none)
    new_block_ids: Int32Array = EMPTY_I32
    #: for the ranks of a model-parallel group that do not sample: the newest earlier
    #: step whose sampled tokens this step's rows need (they collect those first); -1: none
    needs_tokens_of: int = -1


# -- worker -> driver ------------------------------------------------------------------


class RowError(msgspec.Struct, array_like=True, frozen=True):
    """A request that cannot go on (the driver finishes it with this error)."""

    row: int
    request_id: str
    message: str


class StepTimings(msgspec.Struct, array_like=True, frozen=True):
    """Seconds the worker spent on one step, by part: ``prepare`` (message decode,
    batch changes, attention plan, input ids), ``forward`` (the model),
    ``sample`` (sampler, rejection sampler, prompt logprobs) and ``bookkeeping`` (the
    rows' new tokens and the reply's arrays). ``collective``: of ``forward`` and
    ``sample``, the time a rank of a model-parallel group spent in its collectives
    (all-reduces, the logits gather, stage hand-offs, sharing the tokens: waiting for
    the other ranks included)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    bookkeeping: float = 0.0
    collective: float = 0.0


class StepReply(msgspec.Struct, kw_only=True, frozen=True, tag="reply"):
    """What one step produced, as flat arrays in row order.

    ``num_sampled[row]`` tokens per row (0 while a row is still prefilling, more than 1
    when speculative drafts were accepted) are concatenated in ``sampled_token_ids``.
    With logprobs, every sampled token has ``logprobs_width`` entries (the sampled token
    first, then the batch's widest top-k) in ``logprob_token_ids`` / ``logprobs`` and a
    rank in ``logprob_ranks``; rows asking fewer entries use a prefix.
    Prompt logprobs: chunk ``i`` belongs to row ``prompt_logprob_rows[i]`` and covers
    ``prompt_logprob_counts[i]`` prompt positions, each ``prompt_logprobs_width`` wide
    (the actual prompt token first).
    A pooling worker samples nothing: each row whose prompt ends this step gets a
    vector, row ``pooled_rows[i]`` the ``pooled_width`` values at ``i * pooled_width``
    of ``pooled``.
    ``error`` set means the step failed as a whole (a logits processor raised): every
    row is listed in ``failed``. ``timings`` say where the worker's time went.
    """

    version: int
    step_id: int
    num_sampled: Int32Array = EMPTY_I32
    sampled_token_ids: Int32Array = EMPTY_I32
    logprobs_width: int = 0
    logprob_token_ids: Int32Array = EMPTY_I32
    logprobs: Float32Array = EMPTY_F32
    logprob_ranks: Int32Array = EMPTY_I32
    prompt_logprob_rows: Int32Array = EMPTY_I32
    prompt_logprob_counts: Int32Array = EMPTY_I32
    prompt_logprobs_width: int = 0
    prompt_logprob_token_ids: Int32Array = EMPTY_I32
    prompt_logprobs: Float32Array = EMPTY_F32
    prompt_logprob_ranks: Int32Array = EMPTY_I32
    num_draft_tokens: Int32Array = EMPTY_I32
    num_accepted_tokens: Int32Array = EMPTY_I32
    pooled_rows: Int32Array = EMPTY_I32
    pooled_width: int = 0
    pooled: Float32Array = EMPTY_F32
    failed: list[RowError] = []
    error: str | None = None
    timings: StepTimings | None = None


# -- encoding --------------------------------------------------------------------------


class _Header(msgspec.Struct):
    """Read first, so that a message from another version fails on its version."""

    version: int


class Codec:
    """msgpack encoder/decoders for both message kinds (build one per process: msgspec
    encoders cannot be pickled, so a Ray actor makes its own)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._header_decoder = msgspec.msgpack.Decoder(_Header)
        self._step_decoder = msgspec.msgpack.Decoder(StepRequest)
        self._reply_decoder = msgspec.msgpack.Decoder(StepReply)

    def encode(self, message: StepRequest | StepReply) -> bytes:
        return self._encoder.encode(message)

    def decode_step(self, data: bytes) -> StepRequest:
        return self._checked(self._step_decoder, data, "step message")

    def decode_reply(self, data: bytes) -> StepReply:
        return self._checked(self._reply_decoder, data, "step reply")

    def _checked(self, decoder: msgspec.msgpack.Decoder, data: bytes, what: str):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"{what}: expected bytes, got {type(data).__name__}")
        try:
            version = self._header_decoder.decode(data).version
            if version != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"{what}: protocol version {version} at $.version, this side speaks "
                    f"{PROTOCOL_VERSION}"
                )
            return decoder.decode(data)
        # ValidationError (a DecodeError) names the field; bad UTF-8 in a string raises
        # UnicodeDecodeError.
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed {what}: {exc}") from None
