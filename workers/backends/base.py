"""The ModelBackend protocol: what the pipeline needs from a model, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class PromptPlan:
    """A prompt as the model will see it: possibly truncated to the token limit."""

    text: str
    tokens: int
    original_tokens: int
    truncated: bool
    ids: tuple[int, ...] | None = None  # the token ids the model gets, when the backend tokenizes


@dataclass(frozen=True)
class GenerationInput:
    image: Any  # a uint8 RGB tensor [3, H, W], on the CPU or the model's device
    prompt: str
    max_new_tokens: int
    prompt_ids: tuple[int, ...] | None = None  # PromptPlan.ids: used as they are, not re-tokenized
    # Generate exactly max_new_tokens, past the end-of-text token: for timing (calibration, benchmarks),
    # where a model that stops early would make a batch look cheaper than real ones.
    exact_steps: bool = False
    # The image's model input made already (ModelBackend.image_pixels, kept with the decoded photo for
    # its next question): used as it is instead of being made again from `image`.
    pixels: Any = None


@dataclass(frozen=True)
class Prepared:
    """A batch turned into model inputs on the device, ready to run."""

    inputs: Any
    max_new_tokens: tuple[int, ...]
    exact_steps: bool = False


@dataclass(frozen=True)
class GenerationOutput:
    text: str
    output_tokens: int


class ModelBackend(Protocol):
    model_id: str
    revision: str  # what exactly was loaded: the hub commit, or a hash of the model's config
    quantization: str
    device: str
    # Whether the model reads the image's pixels (Fuyu) or only its size (echo: no model): a worker
    # whose model reads none never decodes, and never loads torch.
    needs_pixels: bool

    def load(self) -> None:
        """Load weights onto the device; slow, called once per process."""

    def plan_prompt(self, prompt: str, max_tokens: int, truncate: bool) -> PromptPlan:
        """Count the prompt's tokens and cut it to `max_tokens` if allowed (else PromptTooLong)."""

    def image_tokens(self, height: int, width: int) -> int:
        """How many sequence positions an image of this size takes."""

    def fit_image(self, image: Any) -> Any:
        """Per-image work that can run before the batch, in the decode threads, off the model's
        critical path (Fuyu on the CPU: its shrink-to-fit). May return the image as it is."""

    def image_pixels(self, image: Any) -> Any:
        """The fitted image's model input, where it can be made once per photo in the decode threads
        and kept with it for the photo's next question (Fuyu on the CPU: its normalised patches);
        None: `prepare` makes it for each row."""

    def prepare(self, batch: list[GenerationInput]) -> Prepared:
        """Preprocess images and prompts into model inputs on the device."""

    def run(self, prepared: Prepared) -> list[GenerationOutput]:
        """Greedy generation for a prepared batch; one output per input, in order."""

    def generate(self, batch: list[GenerationInput]) -> list[GenerationOutput]:
        """prepare + run."""

    # --- the iteration-level engine (workers/engine/) ---
    eos_id: int
    # Whether decoding more tokens can change text already decoded beyond a partial character (a
    # tokenizer that cleans up spaces: " ," -> ","): a streamed answer then holds its last word back.
    cleans_spaces: bool
    # Structured answers: the grammar compiler for this model's vocabulary (workers/grammar.py), or
    # None where the backend has no vocabulary to constrain (a job with a response_format fails there).
    grammars: Any

    def slot_positions(self) -> int:
        """The most cache positions one row can hold (a slot's size, workers/engine/kv.py)."""

    def step_model(
        self, slots: int = 2, positions: int | None = None, pool: int | None = None, decode: str | None = None
    ) -> Any:
        """The engine's model calls for `slots` rows at most, in a cache of `pool` positions (each row
        holding its need) or of worst-case slots: a StepModel (workers/engine/runner.py)."""

    def capture(self, runner: Any) -> int:
        """Record the runner's fixed decode steps (CUDA graphs where that applies); how many."""

    def row_inputs(self, item: GenerationInput) -> tuple[Any, int]:
        """One job's unpadded model inputs, and the cache positions they fill."""

    def detokenize(self, tokens: list[int]) -> str:
        """The text of generated tokens (end-of-text excluded)."""

    def settled(self, tokens: list[int]) -> int:
        """How many of a row's first tokens decode to text that later tokens cannot change (a streamed
        answer publishes that much): all but a trailing run of byte-fallback tokens."""

    def kv_capacity(self) -> tuple[int, str]:
        """Cache positions the free memory holds now, and how that was measured."""

    def warm_up(self) -> str:
        """Run one tiny batch (lazy initialisation, kernels); returns the attention kernel that ran."""

    def describe(self) -> dict[str, str]:
        """What /readyz and the results report about the loaded model."""
