"""StreamBP by construction: the model's own decoder-layer module streamed chunk by chunk (`layer`), for
families the engine's own layer math (`engine.stream`) does not serve. transformers' attention reads the
layer's keys and values through its Cache API (`cache`); each chunk's arguments are cut from the whole
sequence's (`arguments`)."""
