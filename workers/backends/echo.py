"""An in-process model for unit tests of the pipeline: answers from the prompt, no torch, no weights.

It serves the iteration-level engine like the real model does (`step_model`: a prefill per row, one
decode step for every running row), so the worker's tests exercise the engine's scheduling, pausing
and failure handling without weights. Its tokens are the answer's words."""

from __future__ import annotations

import time
from typing import Any

from shared.errors import PromptTooLong
from workers.backends import fuyu_geometry
from workers.backends.base import GenerationInput, GenerationOutput, Prepared, PromptPlan

# The default MRC_MAX_PROMPT_TOKENS and MRC_MAX_NEW_TOKENS_LIMIT: a slot as big as a model's.
ECHO_PROMPT_TOKENS, ECHO_NEW_TOKENS = 512, 512

EOS, PAD = 0, 1  # PAD: a paced model's filler, so each answer takes its whole max_new_tokens


class EchoRows:
    """The running batch of the echo model: each row's script (its answer's tokens) and position."""

    def __init__(self, prefilled: dict[str, tuple[list[int], GenerationInput]] | None = None) -> None:
        self._prefilled = prefilled if prefilled is not None else {}  # the steps' rows whose prefill is whole
        self.row_ids: list[str] = []
        self.scripts: dict[str, tuple[list[int], GenerationInput]] = {}
        self.positions: dict[str, int] = {}
        self.read = 0  # positions the last step read (its rows' own: nothing padded)
        self.padding = 0

    def __len__(self) -> int:
        return len(self.row_ids)

    @property
    def width(self) -> int:
        return max(self.positions.values(), default=0)

    @property
    def held(self) -> int:
        return sum(self.positions.values())

    def join(self, row_id: str) -> None:
        self.row_ids.append(row_id)
        self.scripts[row_id], self.positions[row_id] = self._prefilled.pop(row_id), 1

    def absorb(self, other: EchoRows) -> None:
        self.row_ids += other.row_ids
        self.scripts.update(other.scripts)
        self.positions.update(other.positions)

    def take(self, row_ids: set[str]) -> EchoRows:
        taken = EchoRows(self._prefilled)
        taken.row_ids = [r for r in self.row_ids if r in row_ids]
        taken.scripts = {r: self.scripts[r] for r in taken.row_ids}
        taken.positions = {r: self.positions[r] for r in taken.row_ids}
        self.drop(row_ids)
        return taken

    def drop(self, row_ids: set[str], keep: bool = False) -> None:
        self.row_ids = [r for r in self.row_ids if r not in row_ids]
        for row_id in row_ids:
            self.scripts.pop(row_id, None)
            self.positions.pop(row_id, None)


class EchoSteps:
    """The echo model's StepModel (workers/engine/runner.py)."""

    def __init__(self, backend: EchoBackend) -> None:
        self.backend = backend
        self._pending: dict[str, tuple[GenerationInput, int]] = {}  # row -> its input and prompt length
        self._prefilled: dict[str, tuple[list[int], GenerationInput]] = {}

    def new_batch(self) -> EchoRows:
        return EchoRows(self._prefilled)

    def begin(
        self, row_id: str, inputs: Any, length: int, identity: Any = None, need: int | None = None
    ) -> int:
        """A slot for the row (the echo model has no cache: nothing is ever reused)."""
        self._pending[row_id] = (inputs, length)
        return 0

    def catch_up(self, row_id: str) -> int:
        return 0

    def extend(self, chunks: list[tuple[str, int]], masks: Any = None) -> list[int | None]:
        """One call of chunks; a row's whole prompt is where the echo model prefills it (and fails, for
        every row of the call, and paces once)."""
        _no_grammar(masks)
        whole = [(r, self._pending[r][0]) for r, stop in chunks if stop >= self._pending[r][1]]
        if not whole:
            return [None] * len(chunks)
        self.backend.prefills += [item.prompt for _, item in whole]
        self.backend.prefill_calls.append([item.prompt for _, item in whole])
        self._maybe_fail([item for _, item in whole])
        if self.backend.token_s:
            time.sleep(self.backend.token_s)
        firsts: dict[str, int] = {}
        for row_id, item in whole:
            del self._pending[row_id]
            script = self.backend.script(item)
            self._prefilled[row_id] = (script, item)
            firsts[row_id] = script[0]
        return [firsts.get(row_id) for row_id, _ in chunks]

    def sharing(self, row_id: str, writers: list[tuple[str, int]]) -> bool:
        return False  # nothing is cached

    def abandon(self, row_id: str, keep: bool = False) -> None:
        self._pending.pop(row_id, None)
        self._prefilled.pop(row_id, None)

    def decode(self, batch: EchoRows, last_tokens: list[int], masks: Any = None) -> list[int]:
        _no_grammar(masks)
        self.backend.calls.append(len(batch))
        self._maybe_fail([batch.scripts[row_id][1] for row_id in batch.row_ids])
        if self.backend.token_s:
            time.sleep(self.backend.token_s)
        nexts = []
        batch.read = sum(batch.positions[row_id] for row_id in batch.row_ids)
        for row_id in batch.row_ids:
            script, _item = batch.scripts[row_id]
            position = batch.positions[row_id]
            nexts.append(script[position] if position < len(script) else EOS)
            batch.positions[row_id] = position + 1
        return nexts

    def _maybe_fail(self, items: list[GenerationInput]) -> None:
        backend = self.backend
        if backend.fail_on and any(backend.fail_on in item.prompt for item in items):
            raise backend.error


def _no_grammar(masks: Any) -> None:
    """The echo model has no vocabulary to mask (`grammars` is None: constrained jobs are refused
    before they reach it); a mask here would be a fault in the engine."""
    if masks is not None and masks() is not None:
        raise AssertionError("the echo model cannot apply a grammar mask")


class EchoBackend:
    """Deterministic stand-in for a ModelBackend: the answer names the image size and the prompt.

    `fail_on` makes generate raise when a prompt contains that marker, to test fault isolation;
    `token_s` makes each batch take that long per step of its longest answer (a model of known speed).
    """

    model_id = "echo"
    revision = "echo-1"
    quantization = "fp32"
    device = "cpu"

    def __init__(
        self,
        fail_on: str | None = None,
        error: Exception | None = None,
        token_s: float = 0.0,
        needs_pixels: bool = True,
    ) -> None:
        # In-process (the unit tests) it decodes every image as a model would, so the pipeline's
        # decode stage is exercised; as a worker's model (MRC_MODEL=echo) it reads an image's size
        # from its header alone (workers/images.py `sized`) and the worker never loads torch.
        self.needs_pixels = needs_pixels
        self.fail_on = fail_on
        self.token_s = token_s
        self.error = error or RuntimeError("injected model fault")
        self.calls: list[int] = []  # rows of each decode step (and of each old-style batch call)
        self.prefills: list[str] = []  # the prompt of each row the engine prefilled, in order
        self.prefill_calls: list[list[str]] = []  # the prompts each prefill call ended, a call a list
        self.eos_id = EOS
        self.cleans_spaces = False  # words joined by spaces: a longer answer only adds words
        self.grammars = None  # no vocabulary to constrain: jobs with a response_format are refused
        self._vocab: dict[str, int] = {}
        self._words: list[str] = ["", ""]

    def script(self, item: GenerationInput) -> list[int]:
        """The answer as tokens, then end-of-text: the image size and the prompt, word by word. Paced
        (`token_s`), filler follows up to max_new_tokens: every answer then takes its whole length,
        max_new_tokens x token_s, as a batch of the old static model took on any machine."""
        height, width = item.image.shape[-2:]
        tokens = [self._token(word) for word in f"{width}x{height}: {item.prompt}".split()]
        if self.token_s:
            tokens += [PAD] * max(0, item.max_new_tokens - len(tokens))
        return [*tokens, EOS]

    def _token(self, word: str) -> int:
        if word not in self._vocab:
            self._vocab[word] = len(self._words)
            self._words.append(word)
        return self._vocab[word]

    def settled(self, tokens: list[int]) -> int:
        return len(tokens)  # whole words only

    def detokenize(self, tokens: list[int]) -> str:
        return " ".join(self._words[t] for t in tokens if t not in (EOS, PAD))

    def slot_positions(self) -> int:
        """What Fuyu's slot holds at the default limits (largest image, prompt and answer), so the
        settings give echo the slots they give a model (MRC_BATCH_TOKEN_BUDGET / positions)."""
        return fuyu_geometry.max_image_tokens() + 2 + ECHO_PROMPT_TOKENS + ECHO_NEW_TOKENS

    def step_model(
        self, slots: int = 2, positions: int | None = None, pool: int | None = None, decode: str | None = None
    ) -> EchoSteps:
        return EchoSteps(self)

    def capture(self, runner: Any) -> int:
        return 0

    def row_inputs(self, item: GenerationInput) -> tuple[Any, int]:
        height, width = item.image.shape[-2:]
        return item, self.image_tokens(height, width) + len(item.prompt.split())

    def kv_capacity(self) -> tuple[int, str]:
        return 1 << 40, "echo: no cache"

    def load(self) -> None:
        return None

    def plan_prompt(self, prompt: str, max_tokens: int, truncate: bool) -> PromptPlan:
        words = prompt.split()
        if len(words) <= max_tokens:
            return PromptPlan(prompt, len(words), len(words), False)
        if not truncate:
            raise PromptTooLong(f"prompt has {len(words)} tokens; the limit is {max_tokens}", len(words))
        return PromptPlan(" ".join(words[:max_tokens]), max_tokens, len(words), True)

    def image_tokens(self, height: int, width: int) -> int:
        return fuyu_geometry.image_token_count(height, width)

    def fit_image(self, image: Any) -> Any:
        return image

    def image_pixels(self, image: Any) -> Any:
        return None

    def prepare(self, batch: list[GenerationInput]) -> Prepared:
        return Prepared(inputs=list(batch), max_new_tokens=tuple(i.max_new_tokens for i in batch))

    def run(self, prepared: Prepared) -> list[GenerationOutput]:
        batch: list[GenerationInput] = prepared.inputs
        self.calls.append(len(batch))
        if self.fail_on and any(self.fail_on in item.prompt for item in batch):
            raise self.error
        if self.token_s and batch:
            time.sleep(self.token_s * max(item.max_new_tokens for item in batch))
        outputs = []
        for item in batch:
            height, width = item.image.shape[-2:]
            text = f"{width}x{height}: {item.prompt}"[: item.max_new_tokens * 8]
            outputs.append(GenerationOutput(text=text, output_tokens=len(text.split())))
        return outputs

    def generate(self, batch: list[GenerationInput]) -> list[GenerationOutput]:
        return self.run(self.prepare(batch))

    def warm_up(self) -> str:
        """A real backend's warm-up runs the model once; `fail_on` set to exactly "warm up" fails it
        here, for the test of a worker whose model loads but cannot run on its machine."""
        if self.fail_on == "warm up":
            raise self.error
        return "none"

    def describe(self) -> dict[str, str]:
        return {
            "model": self.model_id,
            "quantization": self.quantization,
            "device": self.device,
            "attention_backend": "none",
        }
