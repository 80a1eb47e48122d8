"""The input check that names the first invalid UTF-8 byte of a file, read in chunks."""



def test_first_invalid_utf8_offsets_across_chunks(tmp_path):
    from tritonlm.tokenizer import first_invalid_utf8

    path = tmp_path / "t.txt"
    path.write_bytes("ab é cd ".encode() + b"\xff" + b"e")
    assert first_invalid_utf8(path, chunk_bytes=3) == len("ab é cd ".encode())  # 'é' split over two chunks
    path.write_bytes("ok ☃ fine".encode())
    assert first_invalid_utf8(path, chunk_bytes=2) is None
    path.write_bytes(b"abc\xe2\x98")  # truncated at the end
    assert first_invalid_utf8(path, chunk_bytes=4) == 3
