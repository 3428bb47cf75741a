"""Text handling on the host: tokenizers and chat templates, prompt tokenization off the engine thread, streaming
detokenization with stop strings, structured output's grammars. Imports no jax."""
