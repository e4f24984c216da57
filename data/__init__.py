"""Conversations -> chat-template tokens with an assistant-only loss mask.

Public API (imported from the submodules, so that `import data.config` stays light):
`data.pipeline.prepare_data`, `data.pipeline.PreparedData`, `data.collate.collate`,
`data.collate.length_grouped_batches`, `data.prompts.eval_prompts`, `data.prompts.load_prompt_file`,
`data.sources.load_conversations`, `data.template.tokenize_with_mask`.
"""
