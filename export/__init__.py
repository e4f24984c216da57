"""Export trained heads as folders that serving engines load as they are (see docs/serving.md).

Every folder, and a plain head checkpoint, loads back through `load_export`, the one head loader
(eval and `trainer.init_from` use it). Formats: `native` (our checkpoint layout),
`eagle` (EAGLE-1/2 for SGLang and the EAGLE reference loader), `eagle_vllm` (the same for vLLM),
`eagle3` (EAGLE-3 for SGLang, TensorRT-LLM and the EAGLE repo), `eagle3_vllm` (the same for vLLM),
`speculators` (EAGLE-3 in vLLM's speculators format), `medusa` (FasterDecoding layout read by
TensorRT-LLM), `medusa_vllm` (vLLM's Medusa drafter). Each folder carries `specheads.json` (which
also names the layer-id convention of every file that lists target layers) and a model card
`README.md`.
"""
from export.formats import ENGINE_FORMATS, FORMAT_NAMES, ExportError, get_format, resolve_formats
from export.validate import ExportValidationError, load_export, read_manifest, validate_export
from export.writer import export_all, export_head

__all__ = ["ENGINE_FORMATS", "FORMAT_NAMES", "ExportError", "ExportValidationError", "export_all", "export_head",
           "get_format", "load_export", "read_manifest", "resolve_formats", "validate_export"]
