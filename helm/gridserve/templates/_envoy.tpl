{{/* The Envoy bootstrap of the edge (the ConfigMap in edge.yaml): files/envoy.json.tpl, written by
     helm/generate_edge_config.py from gridserve/edge.py, with this release's values filled in. */}}
{{- define "gridserve.envoyConfig" -}}
{{ tpl (.Files.Get "files/envoy.json.tpl") . }}
{{- end -}}
