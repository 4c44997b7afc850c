// esbuild bundles imported styles into app.css.
declare module "*.css";
