"""A safetensors file that records what the loader reads of it: which tensors through slices (and the indexes
read), and which whole (get_tensor). The sharded-loader tests check each rank reads only its share."""


class RecordingSlice:
    """A safetensors slice that records the indexes read from it."""

    def __init__(self, inner, name: str, reads: dict) -> None:
        self.inner, self.name, self.reads = inner, name, reads

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        self.reads.setdefault(self.name, []).append(index)
        return self.inner[index]


class RecordingFile:
    def __init__(self, inner, reads: dict, whole: list) -> None:
        self.inner, self.reads, self.whole = inner, reads, whole

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def metadata(self):
        return self.inner.metadata()

    def get_slice(self, name):
        return RecordingSlice(self.inner.get_slice(name), name, self.reads)

    def get_tensor(self, name):
        self.whole.append(name)
        return self.inner.get_tensor(name)
