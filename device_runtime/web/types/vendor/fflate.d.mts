// The page imports fflate's browser build from ./vendor/ (server/web.py VENDOR_FILES); its types are the package's.
export * from 'fflate';
