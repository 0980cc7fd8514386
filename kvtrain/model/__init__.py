"""The model: KV shifting attention, layer specs, and the GPT builder."""
