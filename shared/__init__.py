"""What the producer and the workers agree on. Imports nothing from producer/ or workers/, and no torch."""
