//! The OCI image layout `make oci` writes (envoy/oci/build.sh), read as a
//! registry client and Istio's Wasm image fetcher (istio/istio
//! `pkg/wasm/imagefetcher.go`) read it: `oci-layout`, `index.json`, the
//! manifest by digest, its config and layer, every blob checked against its
//! digest and size; then the Wasm image spec's "compat" variant: one
//! `tar+gzip` layer holding `plugin.wasm`, the manifest annotation
//! `module.wasm.image/variant: compat`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const LAYOUT: &str = "target/oci/redis-guard";
const WASM: &str = "target/wasm32-wasip1/release/redis_guard.wasm";
const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";

fn repo_path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

/// The layout's directory; no layout is a failure that says how to make one.
fn layout() -> PathBuf {
    let dir = repo_path(LAYOUT);
    assert!(
        dir.join("index.json").is_file() && dir.join("oci-layout").is_file(),
        "no OCI image layout at {LAYOUT}: run `make oci` (it builds the filter, then envoy/oci/build.sh packs it)"
    );
    dir
}

fn json_of(bytes: &[u8], what: &str) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{what} is not JSON: {e}"))
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The hex of a descriptor's `sha256:<64 hex>` digest.
fn digest_hex(descriptor: &Value) -> Result<String, String> {
    let digest = descriptor["digest"].as_str().unwrap_or_default();
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| format!("digest `{digest}` is not sha256:<hex>"))?;
    if hex.len() != 64
        || !hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(format!("digest `{digest}` is not 64 lower-case hex digits"));
    }
    Ok(hex.to_string())
}

/// A blob is what its descriptor says: the same size, the same SHA-256.
fn verify_blob(bytes: &[u8], descriptor: &Value) -> Result<(), String> {
    let hex = digest_hex(descriptor)?;
    let size = descriptor["size"]
        .as_u64()
        .ok_or_else(|| format!("descriptor without a size: {descriptor}"))?;
    if bytes.len() as u64 != size {
        return Err(format!(
            "blob {hex} has {} bytes, its descriptor says {size}",
            bytes.len()
        ));
    }
    let actual = sha256_hex(bytes);
    if actual != hex {
        return Err(format!("blob {hex} hashes to {actual}"));
    }
    Ok(())
}

fn read_blob(layout: &Path, descriptor: &Value) -> Vec<u8> {
    let hex = digest_hex(descriptor).unwrap_or_else(|e| panic!("{e}"));
    let path = layout.join("blobs/sha256").join(&hex);
    let bytes =
        std::fs::read(&path).unwrap_or_else(|e| panic!("blob {} is missing: {e}", path.display()));
    verify_blob(&bytes, descriptor).unwrap_or_else(|e| panic!("{e}"));
    bytes
}

struct Image {
    layout: PathBuf,
    index: Value,
    manifest_descriptor: Value,
    manifest: Value,
    config: Value,
    /// (descriptor, blob as stored) per layer, in order.
    layers: Vec<(Value, Vec<u8>)>,
}

/// Follows the layout from `index.json` to every blob, checking each one.
fn image() -> Image {
    let layout = layout();
    let marker = json_of(
        &std::fs::read(layout.join("oci-layout")).unwrap(),
        "oci-layout",
    );
    assert_eq!(marker, json!({"imageLayoutVersion": "1.0.0"}), "oci-layout");
    let index = json_of(
        &std::fs::read(layout.join("index.json")).unwrap(),
        "index.json",
    );
    assert_eq!(index["schemaVersion"], 2, "index.json schemaVersion");
    let manifests = index["manifests"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        manifests.len(),
        1,
        "index.json must list one manifest: {index}"
    );
    let manifest_descriptor = manifests[0].clone();
    assert_eq!(manifest_descriptor["mediaType"], MANIFEST_TYPE);
    let manifest = json_of(&read_blob(&layout, &manifest_descriptor), "the manifest");
    assert_eq!(manifest["schemaVersion"], 2, "manifest schemaVersion");
    assert_eq!(manifest["config"]["mediaType"], CONFIG_TYPE);
    let config = json_of(&read_blob(&layout, &manifest["config"]), "the config");
    let layers = manifest["layers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|d| {
            let blob = read_blob(&layout, &d);
            (d, blob)
        })
        .collect();
    Image {
        layout,
        index,
        manifest_descriptor,
        manifest,
        config,
        layers,
    }
}

/// The one layer, uncompressed as its media type says.
fn layer_tar(image: &Image) -> Vec<u8> {
    assert_eq!(
        image.layers.len(),
        1,
        "the compat variant has exactly one layer"
    );
    let (descriptor, blob) = &image.layers[0];
    match descriptor["mediaType"].as_str().unwrap_or_default() {
        LAYER_GZIP => {
            // Like Go's gzip reader, read every member of the stream.
            let mut tar = Vec::new();
            flate2::read::MultiGzDecoder::new(&blob[..])
                .read_to_end(&mut tar)
                .unwrap_or_else(|e| panic!("the layer is not gzip: {e}"));
            tar
        }
        LAYER_TAR => blob.clone(),
        other => panic!("layer media type `{other}` is not an OCI tar layer"),
    }
}

/// (path, is a regular file, contents) of every entry of a tar archive.
fn tar_entries(tar: &[u8]) -> Vec<(String, bool, Vec<u8>)> {
    let mut archive = tar::Archive::new(tar);
    archive
        .entries()
        .unwrap()
        .map(|entry| {
            let mut entry = entry.unwrap_or_else(|e| panic!("unreadable tar entry: {e}"));
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            let regular = entry.header().entry_type() == tar::EntryType::Regular;
            let mut contents = Vec::new();
            entry.read_to_end(&mut contents).unwrap();
            (path, regular, contents)
        })
        .collect()
}

#[test]
fn layout_tags_one_manifest_with_the_crate_version() {
    let image = image();
    assert_eq!(
        image.manifest_descriptor["annotations"]["org.opencontainers.image.ref.name"],
        env!("CARGO_PKG_VERSION"),
        "the tag in {LAYOUT}/index.json: {}",
        image.index
    );
}

#[test]
fn layout_holds_exactly_the_blobs_the_image_references() {
    let image = image();
    let mut referenced = vec![
        digest_hex(&image.manifest_descriptor).unwrap(),
        digest_hex(&image.manifest["config"]).unwrap(),
    ];
    referenced.extend(image.layers.iter().map(|(d, _)| digest_hex(d).unwrap()));
    referenced.sort();
    let mut stored: Vec<String> = std::fs::read_dir(image.layout.join("blobs/sha256"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    stored.sort();
    assert_eq!(stored, referenced, "blobs/sha256 of {LAYOUT}");
    let algorithms: Vec<String> = std::fs::read_dir(image.layout.join("blobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(algorithms, ["sha256"]);
}

#[test]
fn blob_check_rejects_a_wrong_size_or_digest() {
    let blob = b"plugin";
    let good = json!({"digest": format!("sha256:{}", sha256_hex(blob)), "size": 6});
    assert_eq!(verify_blob(blob, &good), Ok(()));
    let wrong_size = json!({"digest": good["digest"], "size": 7});
    assert!(verify_blob(blob, &wrong_size).unwrap_err().contains("7"));
    let wrong_digest = json!({"digest": format!("sha256:{}", sha256_hex(b"other")), "size": 6});
    assert!(verify_blob(blob, &wrong_digest)
        .unwrap_err()
        .contains("hashes to"));
    let not_sha256 = json!({"digest": "md5:0123", "size": 6});
    assert!(verify_blob(blob, &not_sha256).is_err());
}

#[test]
fn manifest_is_marked_as_the_compat_variant() {
    let image = image();
    assert_eq!(
        image.manifest["annotations"]["module.wasm.image/variant"], "compat",
        "manifest annotations: {}",
        image.manifest["annotations"]
    );
}

#[test]
fn image_has_exactly_one_gzip_tar_layer() {
    // Istio's fetcher takes an OCI manifest's layer as the compat variant only
    // if it is application/vnd.oci.image.layer.v1.tar+gzip.
    let image = image();
    let types: Vec<&Value> = image.layers.iter().map(|(d, _)| &d["mediaType"]).collect();
    assert_eq!(types, [LAYER_GZIP]);
}

#[test]
fn layer_holds_only_plugin_wasm_at_the_root() {
    let entries = tar_entries(&layer_tar(&image()));
    let names: Vec<(&str, bool)> = entries.iter().map(|(p, r, _)| (p.as_str(), *r)).collect();
    assert_eq!(names, [("plugin.wasm", true)]);
}

#[test]
fn plugin_wasm_is_the_built_filter() {
    let entries = tar_entries(&layer_tar(&image()));
    let plugin = &entries
        .iter()
        .find(|(p, _, _)| p == "plugin.wasm")
        .expect("plugin.wasm in the layer")
        .2;
    assert!(plugin.starts_with(b"\0asm"), "plugin.wasm is not Wasm");
    let built =
        std::fs::read(repo_path(WASM)).unwrap_or_else(|e| panic!("{WASM}: {e}: run `make oci`"));
    assert!(
        *plugin == built,
        "plugin.wasm ({} bytes, sha256 {}) is not {WASM} ({} bytes, sha256 {}): the filter was rebuilt since, run `make oci` again",
        plugin.len(),
        sha256_hex(plugin),
        built.len(),
        sha256_hex(&built)
    );
}

#[test]
fn layer_is_a_complete_tar_archive() {
    // A tar ends with two zero blocks; some tools (umoci 0.4.7 `insert`) leave
    // them out and GNU tar, Python and scanners then fail on the layer.
    let tar = layer_tar(&image());
    assert_eq!(tar.len() % 512, 0, "not a whole number of tar blocks");
    assert!(
        tar.len() >= 1024 && tar[tar.len() - 1024..].iter().all(|&b| b == 0),
        "the layer lacks the tar end-of-archive blocks"
    );
}

#[test]
fn config_diff_id_is_the_digest_of_the_uncompressed_layer() {
    let image = image();
    let diff_id = format!("sha256:{}", sha256_hex(&layer_tar(&image)));
    assert_eq!(
        image.config["rootfs"],
        json!({"type": "layers", "diff_ids": [diff_id]})
    );
}

#[test]
fn config_is_linux_amd64_the_platform_istio_resolves() {
    // Istio fetches with go-containerregistry's remote.Image, which picks
    // linux/amd64 when a tag names an index; a plain manifest is taken as is.
    let image = image();
    assert_eq!(image.config["os"], "linux");
    assert_eq!(image.config["architecture"], "amd64");
}
