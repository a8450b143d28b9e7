"""The voice store: uploaded and manifest voices, stored where every replica reads them."""
