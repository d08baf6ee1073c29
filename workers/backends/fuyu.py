"""Fuyu through transformers: one loader for Fuyu-8B (local folder or offline HF cache) and the tiny Fuyu."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from shared import prompts
from shared.errors import InvalidJob, ModelError, OutOfMemory, PromptTooLong
from shared.settings import Settings
from workers import inference
from workers.backends import fuyu_geometry, fuyu_loading
from workers.backends import fuyu_preprocess as preprocess
from workers.backends.base import GenerationInput, GenerationOutput, Prepared, PromptPlan

BEGINNING_OF_ANSWER = "<0x04>"  # appended by id, as FuyuProcessor does, never as text
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")  # a byte-fallback token (sentencepiece's spelling)

# Weights cannot be downloaded here, and a production worker must never fetch at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def torch_full_image(height: int, width: int) -> Any:
    import torch

    return torch.full((3, height, width), 128, dtype=torch.uint8)


class FuyuBackend:
    """Fuyu-8B (or the tiny Fuyu) loaded with from_pretrained, generating greedily in batches."""

    needs_pixels = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.source = settings.model
        self.model_id = settings.model
        self.quantization: str = settings.quantization
        self.device = settings.device
        self.model: Any = None
        self.processor: Any = None
        self.attention_kernel = "not_measured"
        self.attention_kernel_padded = "not_measured"
        self.revision = "unloaded"
        self.grammars: Any = None
        self.cleans_spaces = True  # until the tokenizer says: the safe answer for a stream
        self.byte_tokens: frozenset[int] = frozenset()  # byte-fallback pieces, <0x00> .. <0xFF>
        self.vocab_size = 0

    def _path(self) -> str:
        if self.source == "tiny":
            from workers.backends.tiny import TINY_VERSION, ensure_tiny_model

            self.model_id = TINY_VERSION
            return str(ensure_tiny_model(self.settings.home))
        if self.source == "parcels":
            from workers.models import PARCELS_ID, parcels_path

            self.model_id = PARCELS_ID
            return str(parcels_path())
        return str(Path(self.source).expanduser()) if Path(self.source).expanduser().is_dir() else self.source

    def load(self) -> None:
        from transformers import AutoProcessor
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        self.device = fuyu_loading.resolve_device(self.settings.device)
        path = self._path()
        try:
            self.processor = AutoProcessor.from_pretrained(path, local_files_only=True)
            self.model = self._weights(path)
        except OSError as exc:
            raise ModelError(
                f"cannot load model {self.source!r} offline: give MRC_MODEL a local folder with the "
                f"weights, a hub id present in the HF cache, or 'tiny' ({exc})"
            ) from exc
        self.model.eval()
        self.revision = fuyu_loading.revision_of(self.model.config, path)
        tokenizer = self.processor.tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.cleans_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", True))
        vocab = tokenizer.get_vocab()
        # What a byte-fallback run of the decoder reads through: byte pieces, and ids that write nothing
        # (special tokens, skipped; the ids of the padded embedding past the vocabulary).
        self.byte_tokens = frozenset(
            [*(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece)), *tokenizer.all_special_ids]
        )
        self.vocab_size = len(vocab)
        self.token_ids = preprocess.TokenIds(
            image=int(tokenizer.convert_tokens_to_ids("|SPEAKER|")),
            newline=int(tokenizer.convert_tokens_to_ids("|NEWLINE|")),
            bos=int(tokenizer.convert_tokens_to_ids("<s>")),
            pad=0,  # FuyuProcessor pads with id 0
        )
        self.answer_id = int(tokenizer.convert_tokens_to_ids(BEGINNING_OF_ANSWER))
        ids = self.token_ids
        self.control_ids = frozenset(
            {
                ids.image,
                ids.newline,
                ids.bos,
                ids.pad,
                self.eos_id,
                self.answer_id,
                *tokenizer.all_special_ids,
            }
        )
        self.control_text = (*prompts.FUYU_CONTROL_TEXT, *tokenizer.all_special_tokens)
        from workers.grammar import Grammars

        # The logits' width (the lm head's): the model's vocabulary can be larger than the tokenizer's.
        vocab = int(self.model.get_output_embeddings().out_features)
        self.grammars = Grammars(
            tokenizer, vocab, self.eos_id, self.settings.grammar_cache_size,
            limit_s=self.settings.grammar_compile_timeout_s, keep_bytes=self.settings.grammar_cache_bytes,
        )  # fmt: skip

    def _weights(self, path: str) -> Any:
        """The model from its folder or the HF cache. The GPU benchmarks' random Fuyu-8B overrides this
        one step (its weights are made in memory: tests/bench/random_fuyu.py); all else is the worker's."""
        from transformers import FuyuForCausalLM

        return FuyuForCausalLM.from_pretrained(
            path,
            local_files_only=True,
            attn_implementation=self.settings.attention,
            **fuyu_loading.quantization_kwargs(self.quantization, self.device),
        )

    def plan_prompt(self, prompt: str, max_tokens: int, truncate: bool) -> PromptPlan:
        """The ids the model will see: control-token text defused, then checked id by id (the text
        rules cannot know every way a tokenizer might reach a control id), then cut to the limit."""
        tokenizer = self.processor.tokenizer
        text = prompts.neutralise(prompt, self.control_text)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if self.control_ids.intersection(ids):
            raise InvalidJob("the prompt turns into the model's control tokens; rephrase it")
        if len(ids) <= max_tokens:
            return PromptPlan(text, len(ids), len(ids), False, tuple(ids))
        if not truncate:
            raise PromptTooLong(f"prompt has {len(ids)} tokens; the limit is {max_tokens}", len(ids))
        kept = ids[:max_tokens]
        return PromptPlan(tokenizer.decode(kept), max_tokens, len(ids), True, tuple(kept))

    def image_tokens(self, height: int, width: int) -> int:
        return fuyu_geometry.image_token_count(height, width, self.settings.max_image_side)

    def fit_image(self, image: Any) -> Any:
        """On the CPU, shrink in the decode threads, in parallel and off the model's critical path (the
        same operation `prepare` would do, which then finds nothing to shrink). On a GPU the shrink
        runs in `prepare`, on the device, where it is cheap."""
        if self.device != "cpu":
            return image
        return preprocess.resize_to_fit(image, self.settings.max_image_side)

    def image_pixels(self, image: Any) -> Any:
        """On the CPU, the patches (profiled: making them for every question of a photo was more of the
        worker's CPU than the engine's steps). On a GPU `prepare` makes them on the device, where it is
        cheap, and a device's tensor is not kept."""
        if self.device != "cpu":
            return None
        return preprocess.pixels_of(image, self.model.dtype, self.settings.max_image_side)

    def prepare(self, batch: list[GenerationInput]) -> Prepared:
        """Our device-side preprocessing (workers/backends/fuyu_preprocess.py), not the processor's
        CPU path."""
        prompt_ids = [[*self._prompt_ids(item), self.answer_id] for item in batch]
        inputs = preprocess.build_inputs(
            [item.image for item in batch],
            prompt_ids,
            self.token_ids,
            self.model.dtype,
            self.device,
            self.settings.max_image_side,
            made=[item.pixels for item in batch],
        )
        return Prepared(
            inputs=inputs,
            max_new_tokens=tuple(item.max_new_tokens for item in batch),
            exact_steps=all(item.exact_steps for item in batch),
        )

    def _prompt_ids(self, item: GenerationInput) -> tuple[int, ...]:
        if item.prompt_ids is not None:
            return item.prompt_ids
        plan = self.plan_prompt(item.prompt, self.settings.max_prompt_tokens, truncate=True)
        assert plan.ids is not None
        return plan.ids

    def run(self, prepared: Prepared) -> list[GenerationOutput]:
        import torch

        inputs = prepared.inputs
        steps = max(prepared.max_new_tokens)
        if self.device == "cpu":  # threads by the call's size: one for a ticket, the cores for a batch
            from workers import cpu_threads

            cpu_threads.apply(self.settings.cpu_threads, int(inputs["input_ids"].numel()))
        try:
            with torch.inference_mode():
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=steps,
                    min_new_tokens=steps if prepared.exact_steps else None,
                    do_sample=False,
                    pad_token_id=self.token_ids.pad,
                    eos_token_id=self.eos_id,
                )
        except Exception as exc:
            if not inference.out_of_memory(exc):  # CUDA's or the CPU allocator's: the same class of fault
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            rows = len(prepared.max_new_tokens)
            raise OutOfMemory(f"out of memory for a batch of {rows}: {exc}"[:500]) from exc
        new_tokens = out[:, inputs["input_ids"].shape[1] :].tolist()
        return [self._decode(row, n) for row, n in zip(new_tokens, prepared.max_new_tokens, strict=True)]

    def generate(self, batch: list[GenerationInput]) -> list[GenerationOutput]:
        return self.run(self.prepare(batch))

    # ---------------------------------------------------------------- the engine's hooks
    def slot_positions(self) -> int:
        """The most positions one row can hold: the largest image (after resize-to-fit and
        MRC_MAX_IMAGE_SIDE), its begin-of-sequence and begin-of-answer tokens, the longest prompt and
        the most new tokens a job may ask for."""
        settings = self.settings
        image = fuyu_geometry.max_image_tokens(settings.max_image_side)
        return image + 2 + settings.max_prompt_tokens + settings.max_new_tokens_limit

    def decode_mode(self) -> str:
        """MRC_ENGINE_DECODE: `auto` is one fixed-shape call per step on CUDA (captured), rows as they
        are on the CPU (workers/engine/runner.py); rows with flash-attention, which cannot read the
        fixed step's 4-D mask (settings refuse `fixed` with it)."""
        mode = str(self.settings.engine_decode)
        if mode == "auto":
            cuda = self.device.startswith("cuda")
            return "fixed" if cuda and self.settings.attention != "flash_attention_2" else "rows"
        return mode

    def step_model(
        self, slots: int = 2, positions: int | None = None, pool: int | None = None, decode: str | None = None
    ) -> Any:
        """The engine's model calls for `slots` rows at most, in a cache of `pool` positions (rows
        decode: each row holds its need) or of `slots` worst-case slots (workers/engine/runner.py); on
        the CPU, threads by call size; on CUDA, the fixed steps captured as CUDA graphs unless
        MRC_ENGINE_CUDA_GRAPHS=off (a capture that fails is logged and the steps run eagerly).
        `decode`: MRC_ENGINE_DECODE's choice unless said."""
        from workers.engine.runner import Runner

        mode: Any = decode or self.decode_mode()
        positions = positions or self.slot_positions()
        reuse = self.settings.engine_prefix_cache == "on"
        if self.device != "cpu":
            return Runner(self.model, slots, positions, None, mode, reuse, pool)
        from workers import cpu_threads

        requested = self.settings.cpu_threads
        threads = lambda count, kind: cpu_threads.apply(requested, count, kind)  # noqa: E731
        return Runner(self.model, slots, positions, threads, mode, reuse, pool)

    def capture(self, runner: Any) -> int:
        """Record the runner's fixed-shape steps (`fixed`, `pool`) as CUDA graphs; 0 where that does not
        apply or fails."""
        if not self.device.startswith("cuda") or runner.decode_mode not in ("fixed", "pool"):
            return 0
        if self.settings.engine_cuda_graphs == "off":
            return 0
        try:
            return int(runner.capture())
        except Exception as exc:  # a kernel that cannot be captured: eager steps still serve
            from shared import logs

            logs.get_logger().warning("MRC_CUDA_GRAPHS_OFF", error=repr(exc)[:300])
            runner._steps.clear()
            return 0

    def row_inputs(self, item: GenerationInput) -> tuple[Any, int]:
        """One job's unpadded model inputs, and the positions they fill."""
        inputs = self.prepare([item]).inputs
        return inputs, int(inputs["input_ids"].shape[1])

    def detokenize(self, tokens: list[int]) -> str:
        return str(self.processor.tokenizer.decode(tokens, skip_special_tokens=True))

    def settled(self, tokens: list[int]) -> int:
        end = len(tokens)
        while end and (tokens[end - 1] in self.byte_tokens or tokens[end - 1] >= self.vocab_size):
            end -= 1
        return end

    def kv_capacity(self) -> tuple[int, str]:
        """Cache positions that fit in the memory free now (after loading and warm-up, and, on CUDA,
        after the activations of the largest prefill allowed, measured by running one), and how that
        was measured (workers/engine/capacity.py)."""
        from workers.engine import capacity

        dtype = self.model.get_input_embeddings().weight.dtype
        memory, how = capacity.memory_for_cache(self.device, self._largest_prefill())
        per_token = capacity.bytes_per_token(self.model.config, dtype)
        beside = capacity.beside_the_pool(self.model.config, dtype, self.slot_positions(), self.decode_mode())
        held = capacity.positions_held(max(0, memory - beside), per_token)
        return held, f"{how}, less {beside} bytes beside the pool, {per_token} bytes per position"

    def _largest_prefill(self) -> int:
        """Bytes the largest prefill allowed takes on CUDA beyond what is allocated now (0 on the CPU)."""
        if not self.device.startswith("cuda"):
            return 0
        import torch

        side = self.settings.max_image_side
        height = min(fuyu_geometry.MAX_H, side) if side else fuyu_geometry.MAX_H
        width = min(fuyu_geometry.MAX_W, side) if side else fuyu_geometry.MAX_W
        words = self.processor.tokenizer("x " * self.settings.max_prompt_tokens)["input_ids"]
        prompt = tuple(int(i) for i in words)[: self.settings.max_prompt_tokens]
        item = GenerationInput(torch_full_image(height, width), "", 1, prompt_ids=prompt)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        runner = self.step_model(1, 8)
        runner.prefill([self.row_inputs(item)[0]])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del runner
        return int(peak)

    def _decode(self, row: list[int], max_new_tokens: int) -> GenerationOutput:
        # Greedy decoding makes a row's first N tokens the same whatever the batch's longest request.
        row = row[:max_new_tokens]
        if self.eos_id in row:
            row = row[: row.index(self.eos_id)]
        text = self.processor.tokenizer.decode(row, skip_special_tokens=True)
        return GenerationOutput(text=text, output_tokens=len(row))

    def warm_up(self) -> str:
        """Attest, under the profiler, the two attention paths the engine takes: a prefill alone (no
        padding: the causal path) and a decode step of two rows of unequal length, as the engine's
        decode mode runs it (`rows`: each over its own length; `fixed`, `pool`: the bucket, masked). Also runs
        `generate()` once (the benchmarks' static loop). Returns the prefill's kernel."""
        from workers.backends import attention
        from workers.engine import scheduler
        from workers.engine.engine import Engine
        from workers.engine.sequence import Sequence

        small = GenerationInput(image=torch_full_image(48, 64), prompt="warm up", max_new_tokens=4)
        large = GenerationInput(image=torch_full_image(96, 128), prompt="warm", max_new_tokens=4)
        self.generate([small])
        runner = self.step_model(2, 256)
        self.attention_kernel = attention.attest(
            lambda: runner.prefill([self.row_inputs(small)[0]]), self.device
        )
        engine = Engine(runner, scheduler.Limits(2, 0), lambda _row: None)
        for index, item in enumerate((small, large)):
            inputs, positions = self.row_inputs(item)
            engine.submit(Sequence(f"warm-{index}", inputs, positions, 4, self.eos_id, exact_steps=True))
        engine.step()  # both admitted (prefilled, in their slots), one step decoded: the next is decode only
        self.attention_kernel_padded = attention.attest(engine.step, self.device)
        self._warm_grammar(self.step_model(1, 256))  # a cache of its own: the rows above hold theirs
        return self.attention_kernel

    def _warm_grammar(self, runner: Any) -> None:
        """One constrained row to its end: the grammar mask's kernel loads (and fails) here, at start,
        rather than on the first job that asks for a structured answer."""
        from shared.response_format import ChoiceFormat
        from workers.engine import scheduler
        from workers.engine.engine import Engine
        from workers.engine.sequence import Sequence

        done: list[Sequence] = []
        constraint, _ = self.grammars.constraint(ChoiceFormat(type="choice", choices=["yes", "no"]))
        small = GenerationInput(image=torch_full_image(48, 64), prompt="warm up", max_new_tokens=4)
        inputs, positions = self.row_inputs(small)
        engine = Engine(runner, scheduler.Limits(1, 0), done.append)
        engine.submit(Sequence("warm-grammar", inputs, positions, 4, self.eos_id, constraint=constraint))
        while not engine.idle:
            engine.step()
        if done[0].error is not None or self.detokenize(done[0].tokens) not in ("yes", "no"):
            raise ModelError(f"the grammar mask does not hold at warm-up: {done[0].error or done[0].tokens}")

    def describe(self) -> dict[str, str]:
        implementation = str(getattr(getattr(self.model, "config", None), "_attn_implementation", "unknown"))
        return {
            "model": self.model_id,
            "quantization": self.quantization,
            "device": self.device,
            "attention_backend": f"{implementation}:{self.attention_kernel}",
            "attention_backend_decode": f"{implementation}:{self.attention_kernel_padded}",
            "attention_backend_padded": f"{implementation}:{self.attention_kernel_padded}",
        }
