"""The engine: the one way into generation, synchronous and free of trio.

Where a request goes:

1. `build_engine(path, EngineOptions(...))` (build.py) opens the model: `ModelRunner` (runner.py: mmap'd
   weights, the forward pass of models/, the KV block pool of kv.py), the tokenizer, the prefix cache
   (prefix_cache.py) and its file; `Engine.info` is a frozen `ModelInfo` (info.py) with the facts the
   layers above may read.
2. A `GenerationRequest` (types.py) is admitted into a slot (slots.py): the slot reuses the longest prefix
   it can, from its own history or the prefix cache, with hybrid recurrent-state checkpoints.
3. Each `Engine.step(plan)` (engine.py) runs one batched forward over the chunks the scheduler
   (scheduler.py, pure policy) planned, samples (sampler.py), and turns tokens into text, stop strings,
   limits and timings through the request's `RequestOutput` (output.py, detokenizer.py); it returns
   `TokenEvent`s, then a `FinishEvent` or `FailEvent`. A decoding slot's next token may go with drafted tokens
   (drafts.py: n-gram matches in its history and in other requests' outputs), kept only where the sampler
   picks them itself: speculative decoding, which never changes an output.
4. Drivers: `Engine.generate(requests)` runs requests to completion synchronously (basert.Model, the CLI,
   tools, tests); the server's actor calls `admit`, `cancel` and `step` itself between admin messages.
5. `Engine.embed(token_lists, pooling)` (embeddings.py) pools the last hidden states of each input, run as a
   scratch sequence that no slot or cache ever sees.

Saved state (slot snapshots and prefix cache files) is read and written by saved_state.py only.
"""

from basert.engine.build import EngineOptions, build_engine
from basert.engine.engine import Engine
from basert.engine.info import ModelInfo
from basert.engine.types import Event, FailEvent, FinishEvent, GenerationRequest, TokenEvent

__all__ = ["Engine", "EngineOptions", "Event", "FailEvent", "FinishEvent", "GenerationRequest", "ModelInfo",
           "TokenEvent", "build_engine"]
