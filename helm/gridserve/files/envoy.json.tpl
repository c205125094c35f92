{
  "overload_manager": {
    "refresh_interval": "0.25s",
    "resource_monitors": [
      {
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
          "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
          "max_active_downstream_connections": {{ .Values.edge.maxConnections | int64 }}
        }
      },
      {
        "name": "envoy.resource_monitors.fixed_heap",
        "typed_config": {
          "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
          "max_heap_size_bytes": {{ .Values.edge.maxHeapBytes | int64 }}
        }
      }
    ],
    "actions": [
      {
        "name": "envoy.overload_actions.shrink_heap",
        "triggers": [
          {
            "name": "envoy.resource_monitors.fixed_heap",
            "threshold": {
              "value": 0.95
            }
          }
        ]
      },
      {
        "name": "envoy.overload_actions.stop_accepting_requests",
        "triggers": [
          {
            "name": "envoy.resource_monitors.fixed_heap",
            "threshold": {
              "value": 0.98
            }
          }
        ]
      }
    ]
  },
  "static_resources": {
    "listeners": [
      {
        "name": "edge",
        "address": {
          "socket_address": {
            "address": "0.0.0.0",
            "port_value": {{ .Values.edge.port }}
          }
        },
        "filter_chains": [
          {
            {{- if .Values.edge.tls.secretName }}
            "transport_socket": {"name":"envoy.transport_sockets.tls","typed_config":{"@type":"type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext","common_tls_context":{"alpn_protocols":["h2","http/1.1"],"tls_certificates":[{"certificate_chain":{"filename":"/etc/envoy/https/tls.crt"},"private_key":{"filename":"/etc/envoy/https/tls.key"},"watched_directory":{"path":"/etc/envoy/https"}}]}}},
            {{- end }}
            "filters": [
              {
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                  "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                  "stat_prefix": "edge",
                  "codec_type": "AUTO",
                  "stream_idle_timeout": "{{ .Values.edge.streamIdleTimeout }}",
                  "request_headers_timeout": "10s",
                  "request_timeout": "{{ .Values.edge.requestBodyTimeout }}",
                  "common_http_protocol_options": {
                    "idle_timeout": "{{ .Values.edge.connectionIdleTimeout }}",
                    "max_requests_per_connection": {{ .Values.edge.maxRequestsPerConnection | int64 }}
                  },
                  "use_remote_address": true,
                  "xff_num_trusted_hops": {{ .Values.edge.xffNumTrustedHops | int64 }},
                  "local_reply_config": {
                    "mappers": [
                      {
                        "filter": {
                          "status_code_filter": {
                            "comparison": {
                              "op": "GE",
                              "value": {
                                "default_value": 500,
                                "runtime_key": "edge.local_reply.server_error"
                              }
                            }
                          }
                        },
                        "body_format_override": {
                          "json_format": {
                            "error": {
                              "message": "%LOCAL_REPLY_BODY%",
                              "type": "ServiceUnavailableError",
                              "param": null,
                              "code": "%RESPONSE_CODE%"
                            }
                          },
                          "content_type": "application/json"
                        }
                      },
                      {
                        "filter": {
                          "status_code_filter": {
                            "comparison": {
                              "op": "EQ",
                              "value": {
                                "default_value": 404,
                                "runtime_key": "edge.local_reply.not_found"
                              }
                            }
                          }
                        },
                        "body_format_override": {
                          "json_format": {
                            "error": {
                              "message": "%LOCAL_REPLY_BODY%",
                              "type": "NotFoundError",
                              "param": null,
                              "code": "%RESPONSE_CODE%"
                            }
                          },
                          "content_type": "application/json"
                        }
                      },
                      {
                        "filter": {
                          "status_code_filter": {
                            "comparison": {
                              "op": "EQ",
                              "value": {
                                "default_value": 429,
                                "runtime_key": "edge.local_reply.rate_limited"
                              }
                            }
                          }
                        },
                        "body_format_override": {
                          "json_format": {
                            "error": {
                              "message": "%LOCAL_REPLY_BODY%",
                              "type": "RateLimitError",
                              "param": null,
                              "code": "%RESPONSE_CODE%"
                            }
                          },
                          "content_type": "application/json"
                        }
                      }
                    ],
                    "body_format": {
                      "json_format": {
                        "error": {
                          "message": "%LOCAL_REPLY_BODY%",
                          "type": "BadRequestError",
                          "param": null,
                          "code": "%RESPONSE_CODE%"
                        }
                      },
                      "content_type": "application/json"
                    }
                  },
                  "route_config": {
                    "name": "edge",
                    "virtual_hosts": [
                      {
                        {{- if .Values.edge.cors.allowedOrigins }}
                        "typed_per_filter_config": {"envoy.filters.http.cors":{"@type":"type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy","allow_origin_string_match":[{{- range $i, $o := .Values.edge.cors.allowedOrigins }}{{ if $i }},{{ end }}{{ if eq $o "*" }}{"safe_regex":{"regex":".*"}}{{ else }}{"exact":{{ $o | toJson }}}{{ end }}{{ end }}],"forward_not_matching_preflights":false,"allow_methods":{{ join "," .Values.edge.cors.allowedMethods | toJson }},"allow_headers":{{ join "," .Values.edge.cors.allowedHeaders | toJson }},"max_age":"600"}},
                        {{- end }}
                        "name": "gateway",
                        "domains": [
                          "*"
                        ],
                        "routes": [
                          {
                            "match": {
                              "path": "/gridserve.gateway.v1.Gateway/GetStatus"
                            },
                            "route": {
                              "cluster": "gateways_any_state",
                              "timeout": "10s",
                              "retry_policy": {
                                "retry_on": "connect-failure,refused-stream,reset,unavailable",
                                "num_retries": 2,
                                "retry_host_predicate": [
                                  {
                                    "name": "envoy.retry_host_predicates.previous_hosts",
                                    "typed_config": {
                                      "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                                    }
                                  }
                                ],
                                "host_selection_retry_max_attempts": 3
                              }
                            }
                          },
                          {
                            "match": {
                              "path": "/gridserve.gateway.v1.Gateway/GetConsoleFile"
                            },
                            "route": {
                              "cluster": "gateways_any_state",
                              "timeout": "10s",
                              "retry_policy": {
                                "retry_on": "connect-failure,refused-stream,reset,unavailable",
                                "num_retries": 2,
                                "retry_host_predicate": [
                                  {
                                    "name": "envoy.retry_host_predicates.previous_hosts",
                                    "typed_config": {
                                      "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                                    }
                                  }
                                ],
                                "host_selection_retry_max_attempts": 3
                              }
                            },
                            "response_headers_to_add": [
                              {
                                "header": {
                                  "key": "content-security-policy",
                                  "value": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
                                },
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"
                              },
                              {
                                "header": {
                                  "key": "x-frame-options",
                                  "value": "DENY"
                                },
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"
                              },
                              {
                                "header": {
                                  "key": "x-content-type-options",
                                  "value": "nosniff"
                                },
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"
                              },
                              {
                                "header": {
                                  "key": "referrer-policy",
                                  "value": "no-referrer"
                                },
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"
                              }
                            ]
                          },
                          {{- if .Values.edge.cors.allowedOrigins }}
                          {"match":{"prefix":"/","headers":[{"name":":method","string_match":{"exact":"OPTIONS"}},{"name":"origin","string_match":{"safe_regex":{"regex":".+"}}},{"name":"access-control-request-method","string_match":{"safe_regex":{"regex":".+"}}}]},"route":{"cluster":"gateways_any_state","timeout":"10s"}},
                          {{- end }}
                          {
                            "match": {
                              "prefix": "/",
                              "grpc": {}
                            },
                            "route": {
                              "cluster": "gateways",
                              "timeout": "0s",
                              "retry_policy": {
                                "retry_on": "connect-failure,refused-stream,reset,unavailable",
                                "num_retries": 2,
                                "retry_host_predicate": [
                                  {
                                    "name": "envoy.retry_host_predicates.previous_hosts",
                                    "typed_config": {
                                      "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                                    }
                                  }
                                ],
                                "host_selection_retry_max_attempts": 3
                              }
                            }
                          },
                          {
                            "match": {
                              "prefix": "/"
                            },
                            "direct_response": {
                              "status": 404,
                              "body": {
                                "inline_string": "no such route"
                              }
                            }
                          }
                        ]
                      }
                    ]
                  },
                  "http_filters": [
                    {
                      "name": "envoy.filters.http.health_check",
                      "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.health_check.v3.HealthCheck",
                        "pass_through_mode": false,
                        "headers": [
                          {
                            "name": ":path",
                            "string_match": {
                              "exact": "/edge/healthz"
                            }
                          }
                        ]
                      }
                    },
                    {
                      "name": "envoy.filters.http.local_ratelimit",
                      "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                        "stat_prefix": "per_client",
                        "filter_enabled": {
                          "default_value": {
                            "numerator": 100,
                            "denominator": "HUNDRED"
                          },
                          "runtime_key": "edge.per_client"
                        },
                        "filter_enforced": {
                          "default_value": {
                            "numerator": 100,
                            "denominator": "HUNDRED"
                          },
                          "runtime_key": "edge.per_client"
                        },
                        "rate_limits": [
                          {
                            "actions": [
                              {
                                "remote_address": {}
                              }
                            ]
                          }
                        ],
                        "descriptors": [
                          {
                            "entries": [
                              {
                                "key": "remote_address"
                              }
                            ],
                            "token_bucket": {
                              "max_tokens": {{ .Values.edge.maxRequestsPerClientPerSecond | int64 }},
                              "tokens_per_fill": {{ .Values.edge.maxRequestsPerClientPerSecond | int64 }},
                              "fill_interval": "1s"
                            }
                          }
                        ],
                        "always_consume_default_token_bucket": false,
                        "max_dynamic_descriptors": 65536
                      }
                    },
                    {
                      "name": "envoy.filters.http.buffer",
                      "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                        "max_request_bytes": {{ .Values.edge.maxRequestBodyBytes | int64 }}
                      }
                    },
                    {
                      "name": "envoy.filters.http.lua",
                      "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                        "default_source_code": {
                          "inline_string": "\nfunction envoy_on_response(handle)\n  local status = handle:headers():get(\"x-gridserve-http-status\")\n  if status ~= nil then\n    handle:headers():replace(\":status\", status)\n    handle:headers():remove(\"x-gridserve-http-status\")\n  end\nend\n"
                        }
                      }
                    },
                    {
                      "name": "envoy.filters.http.grpc_json_transcoder",
                      "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
                        "proto_descriptor": "/etc/envoy/descriptors/protos.pb",
                        "services": [
                          "gridserve.gateway.v1.Gateway"
                        ],
                        "convert_grpc_status": true,
                        "print_options": {
                          "preserve_proto_field_names": true,
                          "always_print_primitive_fields": true
                        },
                        "ignore_unknown_query_parameters": true
                      }
                    },
                    {{- if .Values.edge.cors.allowedOrigins }}
                    {"name":"envoy.filters.http.cors","typed_config":{"@type":"type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}},
                    {{- end }}
                    {
                      "name": "envoy.filters.http.router",
                      "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                      }
                    }
                  ]
                }
              }
            ]
          }
        ]
      }
    ],
    "clusters": [
      {
        {{- if .Values.tls.enabled }}
        "transport_socket": {"name":"envoy.transport_sockets.tls","typed_config":{"@type":"type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext","common_tls_context":{"alpn_protocols":["h2"],"tls_certificates":[{"certificate_chain":{"filename":"{{ trimSuffix "/" .Values.tls.mountPath }}/tls.crt"},"private_key":{"filename":"{{ trimSuffix "/" .Values.tls.mountPath }}/tls.key"},"watched_directory":{"path":"{{ trimSuffix "/" .Values.tls.mountPath }}"}}],"validation_context":{"trusted_ca":{"filename":"{{ trimSuffix "/" .Values.tls.mountPath }}/ca.crt"},"watched_directory":{"path":"{{ trimSuffix "/" .Values.tls.mountPath }}"},"match_typed_subject_alt_names":[{"san_type":"DNS","matcher":{"exact":"gateway.{{ include "gridserve.tlsDeployment" . }}.gridserve.internal"}},{"san_type":"DNS","matcher":{"safe_regex":{"regex":"gateway-[0-9]+\\.{{ include "gridserve.tlsDeployment" . | replace "." "\\\\." }}\\.gridserve\\.internal"}}}]}}}},
        {{- end }}
        "name": "gateways",
        "type": "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "common_lb_config": {
          "healthy_panic_threshold": {
            "value": 0.0
          }
        },
        "typed_extension_protocol_options": {
          "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {
              "http2_protocol_options": {}
            }
          }
        },
        "load_assignment": {
          "cluster_name": "gateways",
          "endpoints": [
            {
              "lb_endpoints": [
                {
                  "endpoint": {
                    "address": {
                      "socket_address": {
                        "address": "{{ include "gridserve.fullname" . }}-gateway-headless.{{ include "gridserve.svcSuffix" . }}",
                        "port_value": {{ .Values.gateway.port }}
                      }
                    }
                  }
                }
              ]
            }
          ]
        },
        "circuit_breakers": {
          "thresholds": [
            {
              "max_connections": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }},
              "max_pending_requests": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }},
              "max_requests": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }},
              "max_retries": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }}
            }
          ]
        },
        "outlier_detection": {
          "split_external_local_origin_errors": true,
          "consecutive_local_origin_failure": 1,
          "enforcing_consecutive_local_origin_failure": 100,
          "enforcing_consecutive_5xx": 0,
          "enforcing_consecutive_gateway_failure": 0,
          "interval": "{{ .Values.edge.healthCheckInterval }}",
          "base_ejection_time": "5s",
          "max_ejection_percent": 100
        },
        "health_checks": [
          {
            "timeout": "1s",
            "interval": "{{ .Values.edge.healthCheckInterval }}",
            "no_traffic_interval": "{{ .Values.edge.healthCheckInterval }}",
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {}
          }
        ]
      },
      {
        {{- if .Values.tls.enabled }}
        "transport_socket": {"name":"envoy.transport_sockets.tls","typed_config":{"@type":"type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext","common_tls_context":{"alpn_protocols":["h2"],"tls_certificates":[{"certificate_chain":{"filename":"{{ trimSuffix "/" .Values.tls.mountPath }}/tls.crt"},"private_key":{"filename":"{{ trimSuffix "/" .Values.tls.mountPath }}/tls.key"},"watched_directory":{"path":"{{ trimSuffix "/" .Values.tls.mountPath }}"}}],"validation_context":{"trusted_ca":{"filename":"{{ trimSuffix "/" .Values.tls.mountPath }}/ca.crt"},"watched_directory":{"path":"{{ trimSuffix "/" .Values.tls.mountPath }}"},"match_typed_subject_alt_names":[{"san_type":"DNS","matcher":{"exact":"gateway.{{ include "gridserve.tlsDeployment" . }}.gridserve.internal"}},{"san_type":"DNS","matcher":{"safe_regex":{"regex":"gateway-[0-9]+\\.{{ include "gridserve.tlsDeployment" . | replace "." "\\\\." }}\\.gridserve\\.internal"}}}]}}}},
        {{- end }}
        "name": "gateways_any_state",
        "type": "STRICT_DNS",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {
          "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {
              "http2_protocol_options": {}
            }
          }
        },
        "load_assignment": {
          "cluster_name": "gateways_any_state",
          "endpoints": [
            {
              "lb_endpoints": [
                {
                  "endpoint": {
                    "address": {
                      "socket_address": {
                        "address": "{{ include "gridserve.fullname" . }}-gateway-headless.{{ include "gridserve.svcSuffix" . }}",
                        "port_value": {{ .Values.gateway.port }}
                      }
                    }
                  }
                }
              ]
            }
          ]
        },
        "circuit_breakers": {
          "thresholds": [
            {
              "max_connections": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }},
              "max_pending_requests": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }},
              "max_requests": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }},
              "max_retries": {{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }}
            }
          ]
        }
      }
    ]
  }
}
