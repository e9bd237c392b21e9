// The page imports onnxruntime-web's wasm-only build from ./vendor/ (server/web.py VENDOR_FILES); its types are the package's.
export * from 'onnxruntime-web';
