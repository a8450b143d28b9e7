"""LoRA adapters as the tests use them: a checkpoint with an adapter folded into its weights (what a fine-tuned
checkpoint is), to compare an adapter's rows with."""
import os

from safetensors.torch import save_file

from omni_tts.models.qwen3_tts.lora import LoRAAdapter, merge_into
from omni_tts.models.qwen3_tts.weights import read_tensors, safetensors_files


def write_merged(base, adapter: LoRAAdapter, out) -> str:
    """The base checkpoint with the adapter folded into its weights (fp32), beside links to the base's other files."""
    os.makedirs(out)
    for name in os.listdir(base):
        if name != "model.safetensors":
            os.symlink(os.path.realpath(os.path.join(base, name)), os.path.join(out, name))
    merged = merge_into({k: v.float() for k, v in read_tensors(safetensors_files(str(base)), "").items()}, adapter)
    save_file({k: v.contiguous() for k, v in merged.items()}, os.path.join(out, "model.safetensors"))
    return str(out)
