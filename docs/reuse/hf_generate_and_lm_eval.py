"""An hlat checkpoint in the Hugging Face stack: export it, generate with ``transformers``,
and score it with lm-evaluation-harness's ``hf`` backend on a small local task.

    pip install "hlat-train[hf]" "lm_eval>=0.4.9,<0.5" accelerate
    python hf_generate_and_lm_eval.py runs/demo/checkpoints out/

Offline: the task is a local JSON-lines file, and nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK = "python_next_line"
# which of two lines comes next: the context, the two choices, the index of the right one
ITEMS = [
    ("def add(a, b):\n", ["    return a + b\n", "    return a - b - c\n"], 0),
    ("import os\n", ["path = os.path.join('a', 'b')\n", "path = os.walk.join[0]\n"], 0),
    ("for i in range(10):\n", ["print)i(\n", "    print(i)\n"], 1),
    ("class Point:\n", ["    def __init__(self, x, y):\n", "def __init__(x, y, self)\n"], 0),
    ("if __name__ == '__main__':\n", ["main(\n", "    main()\n"], 1),
    ("try:\n    run()\n", ["except ValueError:\n", "expect ValueError;\n"], 0),
]


def export(checkpoints: str, out: str) -> str:
    """A Hugging Face directory (safetensors, config, tokenizer) from the newest checkpoint."""
    from hlat_train import export_hf

    return export_hf(checkpoints, os.path.join(out, "hf"), dtype="float32")


def generate(model_dir: str, prompt: str = "def ", max_new_tokens: int = 16) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def write_task(out: str) -> str:
    """The task's data and definition in ``out/tasks``; returns that folder."""
    folder = Path(out, "tasks")
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"context": c, "choices": ch, "label": label} for c, ch, label in ITEMS]
    (folder / f"{TASK}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(folder / (TASK + '.jsonl')))}}}}}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: label\ntarget_delimiter: ""\n'
        "metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]\n"
    )
    return str(folder)


def score(model_dir: str, tasks: str) -> dict:
    """lm_eval's results for the task: ``acc,none`` and the per-item samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir},dtype=float32",
        tasks=[TASK],
        task_manager=TaskManager(include_path=tasks),
        device="cpu",
        batch_size=4,
        log_samples=True,
    )
    return {"metrics": results["results"][TASK], "samples": results["samples"][TASK]}


if __name__ == "__main__":
    checkpoints, out = sys.argv[1], sys.argv[2]
    model_dir = export(checkpoints, out)
    print(repr(generate(model_dir)))
    print(f"{TASK}: acc {score(model_dir, write_task(out))['metrics']['acc,none']:.3f}")
