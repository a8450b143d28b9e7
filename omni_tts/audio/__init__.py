"""Audio around the model: output encoding, speed change, reference-audio fetching."""
