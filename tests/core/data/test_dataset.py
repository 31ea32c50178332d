

def test_key_settings_name_the_target_size_of_images_and_not_the_rule(tmp_path):
    from PIL import Image

    from diffsynth_core.data import SampleDataset

    Image.new("RGB", (64, 48)).save(tmp_path / "small.png")
    Image.new("RGB", (640, 480)).save(tmp_path / "big.png")
    (tmp_path / "m.csv").write_text("image,prompt\nsmall.png,a\nbig.png,b\n")
    loose = SampleDataset(tmp_path / "m.csv", max_pixels=640 * 480)
    tight = SampleDataset(tmp_path / "m.csv", max_pixels=320 * 240)
    assert loose.key_settings(0) == tight.key_settings(0)  # the small image is unaffected
    assert loose.key_settings(1)["target_size"] == [480, 640]
    assert tight.key_settings(1)["target_size"] == [240, 320]
    assert "max_pixels" not in loose.key_settings(0)
    assert tight.load(1).pixels.shape[-2:] == (240, 320)
