"""What leaves a run: the DCP checkpoint consolidated to safetensors, its eval loss, promotion."""
